// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): valid
// requests at the fuzz model's shape (fuzz_model.h), each framed as its target reads it
// (fuzz_input.h), some cut into slices. Deterministic: the same files on every run.
//   make_corpus <corpus dir>   (writes <dir>/wire_decode, <dir>/validate, <dir>/service)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "sparse_decode/v1/decode.pb.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_methods.h"
#include "tests/fuzz/fuzz_model.h"

namespace {

namespace v1 = sparse_decode::v1;
using namespace sds::fuzz;  // the model's constants

// Small finite bf16 values: a float's top 16 bits.
std::string Bf16(int64_t count, uint32_t seed) {
  std::string out(static_cast<size_t>(count) * 2, '\0');
  for (int64_t i = 0; i < count; ++i) {
    const float f = static_cast<float>((i * 31 + seed * 17) % 200) / 100.0f - 1.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint16_t top = static_cast<uint16_t>(bits >> 16);
    std::memcpy(&out[2 * i], &top, 2);
  }
  return out;
}

std::string Int32s(const std::vector<int32_t>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

template <typename T>
void SetTensor(T* t, v1::DType dtype, const std::vector<int64_t>& shape, std::string data) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::move(data));
}

// Indices valid at `position`: K of them, per KV head when `per_head`.
std::vector<int32_t> Indices(int k, int heads, int64_t position) {
  std::vector<int32_t> out;
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < k; ++i)
      out.push_back(i == 1 ? -1 : static_cast<int32_t>((i * 3 + h) % (position + 1)));
  }
  return out;
}

v1::DecodeRequest Decode(const std::string& id, int layer, int64_t position, int k, bool per_head,
                         uint32_t seed) {
  v1::DecodeRequest r;
  r.set_sequence_id(id);
  r.set_layer(layer);
  r.set_position(position);
  r.set_request_id(seed);
  r.set_return_lse(seed % 2 == 1);
  SetTensor(r.mutable_q(), v1::BF16, {kQHeads, kHeadDim}, Bf16(kQHeads * kHeadDim, seed));
  SetTensor(r.mutable_k(), v1::BF16, {kKvHeads, kHeadDim}, Bf16(kKvHeads * kHeadDim, seed + 1));
  SetTensor(r.mutable_v(), v1::BF16, {kKvHeads, kHeadDim}, Bf16(kKvHeads * kHeadDim, seed + 2));
  SetTensor(r.mutable_gate(), v1::BF16, {kQHeads, kHeadDim}, Bf16(kQHeads * kHeadDim, seed + 3));
  if (per_head) {
    SetTensor(r.mutable_indices(), v1::INT32, {kKvHeads, k},
              Int32s(Indices(k, kKvHeads, position)));
  } else {
    SetTensor(r.mutable_indices(), v1::INT32, {k}, Int32s(Indices(k, 1, position)));
  }
  return r;
}

v1::AppendKVRequest Append(const std::string& id, int layer, int64_t start, int64_t n) {
  v1::AppendKVRequest r;
  r.set_sequence_id(id);
  r.set_layer(layer);
  r.set_start_position(start);
  SetTensor(r.mutable_k(), v1::BF16, {n, kKvHeads, kHeadDim}, Bf16(n * kKvHeads * kHeadDim, 5));
  SetTensor(r.mutable_v(), v1::BF16, {n, kKvHeads, kHeadDim}, Bf16(n * kKvHeads * kHeadDim, 6));
  return r;
}

v1::DecodeLayerRequest Layer(int layer, const std::vector<std::string>& ids, int k, bool per_head) {
  v1::DecodeLayerRequest r;
  r.set_layer(layer);
  r.set_request_id(7);
  const int64_t b = static_cast<int64_t>(ids.size());
  for (const std::string& id : ids) {
    r.add_sequence_ids(id);
    r.add_positions(kPrefilled);
  }
  SetTensor(r.mutable_q(), v1::BF16, {b, kQHeads, kHeadDim}, Bf16(b * kQHeads * kHeadDim, 1));
  SetTensor(r.mutable_gate(), v1::BF16, {b, kQHeads, kHeadDim}, Bf16(b * kQHeads * kHeadDim, 2));
  SetTensor(r.mutable_k(), v1::BF16, {b, kKvHeads, kHeadDim}, Bf16(b * kKvHeads * kHeadDim, 3));
  SetTensor(r.mutable_v(), v1::BF16, {b, kKvHeads, kHeadDim}, Bf16(b * kKvHeads * kHeadDim, 4));
  std::vector<int32_t> indices;
  for (int64_t i = 0; i < b; ++i) {
    const auto one = Indices(k, per_head ? kKvHeads : 1, kPrefilled);
    indices.insert(indices.end(), one.begin(), one.end());
  }
  if (per_head) {
    SetTensor(r.mutable_indices(), v1::INT32, {b, kKvHeads, k}, Int32s(indices));
  } else {
    SetTensor(r.mutable_indices(), v1::INT32, {b, k}, Int32s(indices));
  }
  return r;
}

void Write(const std::filesystem::path& dir, const std::string& name, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root = argv[1];
  const std::string d0 = Decode("s", 0, kPrefilled, kMaxTopk, false, 1).SerializeAsString();
  const std::string d1 = Decode("s", 1, kPrefilled, 5, true, 2).SerializeAsString();
  const std::string d2 = Decode("other", 1, 3, 0, false, 3).SerializeAsString();
  v1::DecodeBatchRequest batch;
  *batch.add_requests() = Decode("s", 0, kPrefilled, 8, true, 4);
  *batch.add_requests() = Decode("s", 1, kPrefilled, 8, false, 5);
  *batch.add_requests() = Decode("missing", 0, 0, 1, false, 6);
  const std::string b = batch.SerializeAsString();
  const std::string a = Append("s", 0, kPrefilled, 3).SerializeAsString();
  const std::string a1 = Append("s", 1, 0, 1).SerializeAsString();

  // wire_decode: selector bit 0 = batch; param 31 = the server's item limit.
  const std::filesystem::path wire = root / "wire_decode";
  Write(wire, "decode_whole", Frame(0, 0, {}, d0));
  Write(wire, "decode_cut3", Frame(0, 0, {7, 300, 301}, d1));
  Write(wire, "decode_cut7", Frame(0, 0, {1, 2, 40, 41, 600, 900, 1500}, d0));
  Write(wire, "decode_k0", Frame(0, 0, {}, d2));
  Write(wire, "batch_whole", Frame(1, 31, {}, b));
  Write(wire, "batch_cut4", Frame(1, 31, {3, 1200, 1201, 2500}, b));
  Write(wire, "batch_limit2", Frame(1, 2, {}, b));
  Write(wire, "batch_empty_items",
        Frame(1, 3, {}, std::string("\x0a\x00\x0a\x00\x0a\x00\x0a\x00", 8)));

  // validate: selector % 3 = decode, batch, append; param = AllFiniteBf16's offset.
  const std::filesystem::path val = root / "validate";
  Write(val, "decode", Frame(0, 0, {}, d0));
  Write(val, "decode_per_head_cut", Frame(0, 3, {100, 101, 513}, d1));
  Write(val, "decode_k0", Frame(0, 1, {}, d2));
  Write(val, "batch", Frame(1, 0, {5, 700}, b));
  Write(val, "append", Frame(2, 0, {}, a));
  Write(val, "append_one", Frame(2, 5, {}, a1));

  // service: selector = method; unary bodies cut into slices, streams into messages.
  const std::filesystem::path svc = root / "service";
  v1::CreateSequenceRequest create;
  create.set_sequence_id("n");
  create.set_reserve_tokens(40);
  v1::ForkSequenceRequest fork;
  fork.set_sequence_id("s");
  fork.set_new_sequence_id("f");
  v1::ReleaseSequenceRequest release;
  release.set_sequence_id("s");
  v1::RegisterRegionRequest region;
  region.set_name("r");
  region.mutable_system()->set_shm_name("/sds_fuzz_absent");
  region.mutable_system()->set_byte_size(4096);
  v1::UnregisterRegionRequest unregister;
  const std::string l1 = Layer(0, {"s"}, kMaxTopk, false).SerializeAsString();
  const std::string l2 = Layer(1, {"s", "x"}, 4, true).SerializeAsString();
  Write(svc, "model_info", Frame(kGetModelInfo, 0, {}, ""));
  Write(svc, "create", Frame(kCreateSequence, 0, {}, create.SerializeAsString()));
  Write(svc, "append", Frame(kAppendKV, 0, {}, a));
  Write(svc, "append_cut", Frame(kAppendKV, 0, {11, 2000}, a));
  Write(svc, "decode", Frame(kDecode, 0, {}, d0));
  Write(svc, "decode_cut", Frame(kDecode, 0, {9, 10, 800}, d1));
  Write(svc, "batch", Frame(kDecodeBatch, 0, {}, b));
  // Two messages: the second at the position after the first.
  const std::string d0_next = Decode("s", 0, kPrefilled + 1, 4, false, 8).SerializeAsString();
  Write(svc, "stream", Frame(kDecodeStream, 0, {static_cast<uint16_t>(d0.size())}, d0 + d0_next));
  Write(svc, "fork", Frame(kForkSequence, 0, {}, fork.SerializeAsString()));
  Write(svc, "release", Frame(kReleaseSequence, 0, {}, release.SerializeAsString()));
  Write(svc, "register_region", Frame(kRegisterRegion, 0, {}, region.SerializeAsString()));
  Write(svc, "unregister_region", Frame(kUnregisterRegion, 0, {}, unregister.SerializeAsString()));
  Write(svc, "list_regions", Frame(kListRegions, 0, {}, ""));
  Write(svc, "layer", Frame(kDecodeLayer, 0, {}, l1));
  Write(svc, "layer_two_items", Frame(kDecodeLayer, 0, {64}, l2));
  Write(svc, "layer_stream",
        Frame(kDecodeLayerStream, 0, {static_cast<uint16_t>(l1.size())}, l1 + l2));
  return 0;
}
