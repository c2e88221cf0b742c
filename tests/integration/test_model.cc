#include "tests/integration/test_model.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/reference/reference_decode.h"

namespace sds::itest {

std::vector<std::string> TestModel::Flags() const {
  std::vector<std::string> flags = {
      absl::StrCat("--num_layers=", num_layers),     absl::StrCat("--num_q_heads=", num_q_heads),
      absl::StrCat("--num_kv_heads=", num_kv_heads), absl::StrCat("--head_dim=", head_dim),
      absl::StrCat("--page_size=", page_size),       absl::StrCat("--max_topk=", max_topk),
      absl::StrCat("--cache_pages=", cache_pages)};
  if (scale_mode == ScaleMode::kPerTokenHead) {
    flags.push_back("--scale_mode=per_token_head");
  } else {
    flags.push_back("--scale_mode=per_tensor");
    flags.push_back(absl::StrCat("--k_scales=", absl::StrJoin(k_scales, ",")));
    flags.push_back(absl::StrCat("--v_scales=", absl::StrJoin(v_scales, ",")));
  }
  return flags;
}

std::vector<uint16_t> InputGen::Bf16(size_t count, float amplitude) {
  std::uniform_real_distribution<float> dist(-amplitude, amplitude);
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = ref::FloatToBf16(dist(rng_));
  return bits;
}

std::vector<int32_t> InputGen::Indices(int64_t position, int32_t count, bool with_skips) {
  std::uniform_int_distribution<int64_t> pick(0, position);
  std::vector<int32_t> indices(count);
  for (int32_t i = 0; i < count; ++i) {
    indices[i] = static_cast<int32_t>(pick(rng_));
    if (with_skips && i % 7 == 3) indices[i] = -1;
    if (with_skips && i % 11 == 5 && i > 0) indices[i] = indices[i - 1];  // duplicate
  }
  return indices;
}

v1::Tensor Bf16Tensor(const std::vector<int64_t>& shape, const std::vector<uint16_t>& bits) {
  v1::Tensor t;
  t.set_dtype(v1::BF16);
  for (int64_t dim : shape) t.add_shape(dim);
  t.set_data(bits.data(), bits.size() * 2);
  return t;
}

v1::Tensor Int32Tensor(const std::vector<int64_t>& shape, const std::vector<int32_t>& values) {
  v1::Tensor t;
  t.set_dtype(v1::INT32);
  for (int64_t dim : shape) t.add_shape(dim);
  t.set_data(values.data(), values.size() * 4);
  return t;
}

v1::DecodeRequest RandomDecode(InputGen& gen, const TestModel& m, const std::string& sequence,
                               int32_t layer, int64_t position, int32_t topk, bool per_kv_head,
                               uint64_t request_id) {
  v1::DecodeRequest r;
  r.set_sequence_id(sequence);
  r.set_layer(layer);
  r.set_position(position);
  r.set_request_id(request_id);
  r.set_return_lse(request_id % 2 == 0);
  const int64_t hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  *r.mutable_q() = Bf16Tensor({hq, d}, gen.Bf16(hq * d, 2.0f));
  *r.mutable_k() = Bf16Tensor({hkv, d}, gen.Bf16(hkv * d, 2.0f));
  *r.mutable_v() = Bf16Tensor({hkv, d}, gen.Bf16(hkv * d, 2.0f));
  *r.mutable_gate() = Bf16Tensor({hq, d}, gen.Bf16(hq * d, 3.0f));
  if (per_kv_head) {
    std::vector<int32_t> all;
    for (int64_t j = 0; j < hkv; ++j) {
      std::vector<int32_t> list = gen.Indices(position, topk, true);
      all.insert(all.end(), list.begin(), list.end());
    }
    *r.mutable_indices() = Int32Tensor({hkv, topk}, all);
  } else {
    std::vector<int32_t> list = gen.Indices(position, topk, true);
    if (topk > 0) list[0] = static_cast<int32_t>(position);  // the new token itself
    *r.mutable_indices() = Int32Tensor({topk}, list);
  }
  return r;
}

v1::AppendKVRequest RandomAppend(InputGen& gen, const TestModel& m, const std::string& sequence,
                                 int32_t layer, int64_t start, int64_t count) {
  v1::AppendKVRequest r;
  r.set_sequence_id(sequence);
  r.set_layer(layer);
  r.set_start_position(start);
  const int64_t hkv = m.num_kv_heads, d = m.head_dim;
  *r.mutable_k() = Bf16Tensor({count, hkv, d}, gen.Bf16(count * hkv * d, 2.0f));
  *r.mutable_v() = Bf16Tensor({count, hkv, d}, gen.Bf16(count * hkv * d, 2.0f));
  return r;
}

std::unique_ptr<grpc::ClientContext> Context(const std::string& tenant,
                                             std::chrono::milliseconds timeout,
                                             const std::string& bearer) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + timeout);
  if (!tenant.empty()) context->AddMetadata("x-tenant-id", tenant);
  if (!bearer.empty()) context->AddMetadata("authorization", "Bearer " + bearer);
  return context;
}

}  // namespace sds::itest
