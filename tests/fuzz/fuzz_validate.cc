// libFuzzer target: request validation (server/validate.h) on messages parsed from the
// input. Properties, besides ASan and UBSan staying quiet:
// - a DecodeRequest (or each item of a DecodeBatchRequest) gets the same verdict, code
//   and message, with its tensor data in wire slices cut at fuzzer-chosen bytes as in
//   one protobuf string;
// - an accepted decode or append is what the contract says: the model's shapes and
//   byte sizes, finite bf16 values, each index -1 or in [0, position];
// - every error is INVALID_ARGUMENT;
// - AllFiniteBf16 agrees with a per-element check at any alignment.
// Selector % 3: 0 DecodeRequest, 1 DecodeBatchRequest, 2 AppendKVRequest.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "server/tensor_bytes.h"
#include "server/validate.h"
#include "server/wire_decode.h"
#include "server/work.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_model.h"

namespace {

namespace v1 = sparse_decode::v1;
using sds::server::DecodeItem;
using sds::server::DecodeTensorBytes;

const sds::server::ModelShape kModel = sds::fuzz::FuzzModel();

bool FiniteReference(const std::string& bytes) {
  for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + i, 2);
    if ((bits & 0x7F80) == 0x7F80) return false;
  }
  return true;
}

bool ShapeIs(const v1::Tensor& t, std::vector<int64_t> shape) {
  return std::vector<int64_t>(t.shape().begin(), t.shape().end()) == shape;
}

// What an accepted decode must satisfy, checked from the typed message alone.
void CheckAcceptedDecode(const v1::DecodeRequest& r) {
  const int64_t q = int64_t{kModel.num_q_heads} * kModel.head_dim;
  const int64_t kv = int64_t{kModel.num_kv_heads} * kModel.head_dim;
  SDS_FUZZ_CHECK(!r.sequence_id().empty() && r.layer() >= 0 && r.layer() < kModel.num_layers &&
                     r.position() >= 0,
                 "%s", r.ShortDebugString().c_str());
  for (const v1::Tensor* t : {&r.q(), &r.gate()}) {
    SDS_FUZZ_CHECK(t->dtype() == v1::BF16 && ShapeIs(*t, {kModel.num_q_heads, kModel.head_dim}) &&
                       static_cast<int64_t>(t->data().size()) == 2 * q &&
                       FiniteReference(t->data()),
                   "q or gate accepted: %s", t->ShortDebugString().c_str());
  }
  for (const v1::Tensor* t : {&r.k(), &r.v()}) {
    SDS_FUZZ_CHECK(t->dtype() == v1::BF16 && ShapeIs(*t, {kModel.num_kv_heads, kModel.head_dim}) &&
                       static_cast<int64_t>(t->data().size()) == 2 * kv &&
                       FiniteReference(t->data()),
                   "k or v accepted: %s", t->ShortDebugString().c_str());
  }
  const v1::Tensor& ix = r.indices();
  SDS_FUZZ_CHECK(ix.dtype() == v1::INT32 && (ix.shape_size() == 1 || ix.shape_size() == 2),
                 "indices accepted: %s", ix.ShortDebugString().c_str());
  const int64_t k = ix.shape(ix.shape_size() - 1);
  const int64_t count = ix.shape_size() == 1 ? k : ix.shape(0) * k;
  SDS_FUZZ_CHECK(k >= 0 && k <= kModel.max_topk &&
                     (ix.shape_size() == 1 || ix.shape(0) == kModel.num_kv_heads) &&
                     static_cast<int64_t>(ix.data().size()) == 4 * count,
                 "indices accepted: %s", ix.ShortDebugString().c_str());
  for (int64_t i = 0; i < count; ++i) {
    int32_t index;
    std::memcpy(&index, ix.data().data() + 4 * i, 4);
    SDS_FUZZ_CHECK(index == -1 || (index >= 0 && index <= r.position()),
                   "index %d accepted at position %lld", index,
                   static_cast<long long>(r.position()));
  }
}

// One decode's verdict over the slices' views against the typed message's own data.
void CheckDecode(const v1::DecodeRequest& wire, const DecodeTensorBytes& bytes,
                 const v1::DecodeRequest& typed) {
  DecodeItem item;
  const absl::Status over_slices = sds::server::ValidateDecode(wire, bytes, kModel, &item);
  const absl::Status one_piece = sds::server::ValidateDecode(typed, kModel);
  SDS_FUZZ_CHECK(over_slices == one_piece, "slices: %s, one piece: %s",
                 over_slices.ToString().c_str(), one_piece.ToString().c_str());
  SDS_FUZZ_CHECK(one_piece.ok() || one_piece.code() == absl::StatusCode::kInvalidArgument, "%s",
                 one_piece.ToString().c_str());
  if (!one_piece.ok()) return;
  CheckAcceptedDecode(typed);
  SDS_FUZZ_CHECK(item.layer == typed.layer() && item.position == typed.position() &&
                     item.sequence_id == typed.sequence_id(),
                 "item fields differ from the request");
}

void FuzzAllFinite(const std::string& body, uint8_t param) {
  const size_t offset = param % 8;  // any alignment
  if (body.size() < offset) return;
  const std::string rest = body.substr(offset);
  const int64_t n = static_cast<int64_t>(rest.size() / 2);
  SDS_FUZZ_CHECK(sds::server::AllFiniteBf16(body.data() + offset, n) == FiniteReference(rest),
                 "AllFiniteBf16 differs at offset %zu over %lld values", offset,
                 static_cast<long long>(n));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sds::fuzz::FramedInput in;
  if (!sds::fuzz::ParseFramed(data, size, &in)) return -1;
  FuzzAllFinite(in.body, in.param);
  switch (in.selector % 3) {
    case 0: {
      v1::DecodeRequest typed;
      if (!typed.ParseFromString(in.body)) return 0;
      const grpc::ByteBuffer buffer = sds::fuzz::SlicedBuffer(in);
      sds::server::WireMessage message;
      v1::DecodeRequest wire;
      DecodeTensorBytes bytes;
      // fuzz_wire_decode checks that both parsers agree; here only the verdicts matter.
      if (!message.Take(buffer).ok() || !message.ParseDecodeRequest(&wire, &bytes).ok()) return 0;
      CheckDecode(wire, bytes, typed);
      return 0;
    }
    case 1: {
      v1::DecodeBatchRequest typed;
      if (!typed.ParseFromString(in.body)) return 0;
      const grpc::ByteBuffer buffer = sds::fuzz::SlicedBuffer(in);
      sds::server::WireMessage message;
      v1::DecodeBatchRequest wire;
      std::vector<DecodeTensorBytes> bytes;
      if (!message.Take(buffer).ok() || !message.ParseDecodeBatch(&wire, &bytes, 1024).ok()) {
        return 0;
      }
      for (int i = 0; i < wire.requests_size() && i < typed.requests_size(); ++i) {
        CheckDecode(wire.requests(i), bytes[i], typed.requests(i));
      }
      return 0;
    }
    default: {
      v1::AppendKVRequest r;
      if (!r.ParseFromString(in.body)) return 0;
      const absl::Status s = sds::server::ValidateAppend(r, kModel);
      SDS_FUZZ_CHECK(s.ok() || s.code() == absl::StatusCode::kInvalidArgument, "%s",
                     s.ToString().c_str());
      if (!s.ok()) return 0;
      SDS_FUZZ_CHECK(!r.sequence_id().empty() && r.layer() >= 0 && r.layer() < kModel.num_layers &&
                         r.start_position() >= 0,
                     "%s", r.ShortDebugString().c_str());
      for (const v1::Tensor* t : {&r.k(), &r.v()}) {
        SDS_FUZZ_CHECK(t->dtype() == v1::BF16 && t->shape_size() == 3 && t->shape(0) >= 1 &&
                           t->shape(1) == kModel.num_kv_heads && t->shape(2) == kModel.head_dim &&
                           static_cast<int64_t>(t->data().size()) ==
                               2 * t->shape(0) * kModel.num_kv_heads * kModel.head_dim &&
                           FiniteReference(t->data()),
                       "append accepted: %s", t->ShortDebugString().c_str());
      }
      SDS_FUZZ_CHECK(r.start_position() + r.k().shape(0) <= (int64_t{1} << 31),
                     "append past 2^31 accepted");
      return 0;
    }
  }
}
