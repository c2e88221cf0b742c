#include "server/response_wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

// Field numbers of decode.proto, all below 16: one-byte tags.
constexpr int kTensorDtype = v1::Tensor::kDtypeFieldNumber;
constexpr int kTensorShape = v1::Tensor::kShapeFieldNumber;
constexpr int kTensorData = v1::Tensor::kDataFieldNumber;
constexpr int kRequestId = v1::DecodeResponse::kRequestIdFieldNumber;
constexpr int kOut = v1::DecodeResponse::kOutFieldNumber;
constexpr int kLse = v1::DecodeResponse::kLseFieldNumber;
constexpr int kBatch = v1::DecodeResponse::kBatchFieldNumber;
constexpr int kErrorCode = v1::DecodeResponse::kErrorCodeFieldNumber;
constexpr int kErrorMessage = v1::DecodeResponse::kErrorMessageFieldNumber;
constexpr int kBatchResponses = v1::DecodeBatchResponse::kResponsesFieldNumber;
// Canonical order (protobuf writes fields by number) and one-byte tags.
static_assert(kTensorDtype < kTensorShape && kTensorShape < kTensorData && kTensorData < 16);
static_assert(kRequestId < kOut && kOut < kLse && kLse < kBatch && kBatch < kErrorCode &&
              kErrorCode < kErrorMessage && kErrorMessage < 16 && kBatchResponses < 16);
constexpr size_t kTagBytes = 1;

TensorView ViewOf(const v1::Tensor& t) {
  return TensorView{t.dtype(), absl::MakeConstSpan(t.shape().data(), t.shape_size()), t.data()};
}

size_t PackedShapeBytes(absl::Span<const int64_t> shape) {
  size_t n = 0;
  for (int64_t v : shape) n += WireFormatLite::Int64Size(v);
  return n;
}

size_t TensorBodySize(const TensorView& t) {
  size_t n = 0;
  if (t.dtype != v1::DTYPE_UNSPECIFIED) n += kTagBytes + WireFormatLite::EnumSize(t.dtype);
  if (!t.shape.empty()) {
    n += kTagBytes + WireFormatLite::LengthDelimitedSize(PackedShapeBytes(t.shape));
  }
  if (!t.data.empty()) n += kTagBytes + WireFormatLite::LengthDelimitedSize(t.data.size());
  return n;
}

uint8_t* WriteHeader(int field, size_t length, uint8_t* p) {
  p = WireFormatLite::WriteTagToArray(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, p);
  return CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(length), p);
}

uint8_t* WriteTensor(int field, const TensorView& t, uint8_t* p) {
  p = WriteHeader(field, TensorBodySize(t), p);
  if (t.dtype != v1::DTYPE_UNSPECIFIED)
    p = WireFormatLite::WriteEnumToArray(kTensorDtype, t.dtype, p);
  if (!t.shape.empty()) {
    p = WriteHeader(kTensorShape, PackedShapeBytes(t.shape), p);
    for (int64_t v : t.shape) p = WireFormatLite::WriteInt64NoTagToArray(v, p);
  }
  if (!t.data.empty()) {
    p = WriteHeader(kTensorData, t.data.size(), p);
    std::memcpy(p, t.data.data(), t.data.size());
    p += t.data.size();
  }
  return p;
}

// The tensors to write: the views, else the message's own fields where present.
struct Tensors {
  Tensors(const v1::DecodeResponse& fields, const TensorView* out_view,
          const TensorView* lse_view) {
    has_out = out_view != nullptr || fields.has_out();
    has_lse = lse_view != nullptr || fields.has_lse();
    if (has_out) out = out_view ? *out_view : ViewOf(fields.out());
    if (has_lse) lse = lse_view ? *lse_view : ViewOf(fields.lse());
  }
  bool has_out, has_lse;
  TensorView out, lse;
};

size_t BodySize(const v1::DecodeResponse& f, const Tensors& t) {
  size_t n = 0;
  if (f.request_id() != 0) n += kTagBytes + WireFormatLite::UInt64Size(f.request_id());
  if (t.has_out) n += kTagBytes + WireFormatLite::LengthDelimitedSize(TensorBodySize(t.out));
  if (t.has_lse) n += kTagBytes + WireFormatLite::LengthDelimitedSize(TensorBodySize(t.lse));
  if (f.has_batch()) n += kTagBytes + WireFormatLite::LengthDelimitedSize(f.batch().ByteSizeLong());
  if (f.error_code() != 0) n += kTagBytes + WireFormatLite::Int32Size(f.error_code());
  if (!f.error_message().empty()) {
    n += kTagBytes + WireFormatLite::LengthDelimitedSize(f.error_message().size());
  }
  return n;
}

uint8_t* WriteBody(const v1::DecodeResponse& f, const Tensors& t, uint8_t* p) {
  if (f.request_id() != 0) p = WireFormatLite::WriteUInt64ToArray(kRequestId, f.request_id(), p);
  if (t.has_out) p = WriteTensor(kOut, t.out, p);
  if (t.has_lse) p = WriteTensor(kLse, t.lse, p);
  if (f.has_batch()) {
    p = WriteHeader(kBatch, f.batch().ByteSizeLong(), p);  // also caches the size written next
    p = f.batch().SerializeWithCachedSizesToArray(p);
  }
  if (f.error_code() != 0) p = WireFormatLite::WriteInt32ToArray(kErrorCode, f.error_code(), p);
  if (!f.error_message().empty()) {
    p = WriteHeader(kErrorMessage, f.error_message().size(), p);
    std::memcpy(p, f.error_message().data(), f.error_message().size());
    p += f.error_message().size();
  }
  return p;
}

}  // namespace

size_t DecodeResponseSize(const v1::DecodeResponse& fields, const TensorView* out,
                          const TensorView* lse) {
  return BodySize(fields, Tensors(fields, out, lse));
}

uint8_t* WriteDecodeResponse(const v1::DecodeResponse& fields, const TensorView* out,
                             const TensorView* lse, uint8_t* target) {
  return WriteBody(fields, Tensors(fields, out, lse), target);
}

void EncodeDecodeResponse(const v1::DecodeResponse& fields, const TensorView* out,
                          const TensorView* lse, EncodedResponse* encoded) {
  const Tensors tensors(fields, out, lse);
  const size_t body = BodySize(fields, tensors);
  const size_t total =
      encoded->batch_item ? kTagBytes + WireFormatLite::LengthDelimitedSize(body) : body;
  grpc::Slice slice(total);  // fresh uninitialised bytes, ours alone (refcount 1)
  uint8_t* p = const_cast<uint8_t*>(slice.begin());
  if (encoded->batch_item) p = WriteHeader(kBatchResponses, body, p);
  p = WriteBody(fields, tensors, p);
  if (p != slice.end()) {  // BodySize and WriteBody disagree: memory is already corrupt
    spdlog::critical("response_wire: wrote {} bytes of a {}-byte answer", p - slice.begin(), total);
    std::abort();
  }
  encoded->bytes = std::move(slice);
}

absl::StatusOr<grpc::ByteBuffer> DecodeReply(const EncodedResponse& encoded) {
  if (encoded.empty()) {
    return absl::InternalError("a decode was answered without an encoded response");
  }
  return grpc::ByteBuffer(&encoded.bytes, 1);
}

absl::StatusOr<grpc::ByteBuffer> DecodeBatchReply(const v1::DecodeBatchResponse& typed,
                                                  std::vector<EncodedResponse>* encoded) {
  std::vector<grpc::Slice> slices;
  slices.reserve(encoded->size());
  for (size_t i = 0; i < encoded->size(); ++i) {
    EncodedResponse& item = (*encoded)[i];
    if (item.empty()) {
      const v1::DecodeResponse& slot = typed.responses(static_cast<int>(i));
      if (slot.error_code() == 0) {
        return absl::InternalError(
            absl::StrCat("decode batch item ", i, " was answered without an encoded response"));
      }
      item.batch_item = true;
      EncodeDecodeResponse(slot, nullptr, nullptr, &item);
    }
    slices.push_back(item.bytes);
  }
  if (slices.empty()) slices.emplace_back();  // an empty message: one empty slice
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void AnswerEncoder::Encode(uint64_t request_id, const BatchInfo& batch, const uint16_t* out,
                           const float* lse, EncodedResponse* encoded) const {
  // The small fields only, in a message kept per thread: its BatchInfo is allocated once.
  thread_local v1::DecodeResponse fields;
  fields.set_request_id(request_id);
  v1::BatchInfo* info = fields.mutable_batch();
  info->set_batch_id(batch.batch_id);
  info->set_batch_size(batch.batch_size);
  info->set_queue_us(batch.queue_us);
  info->set_compute_us(batch.compute_us);
  const size_t out_bytes = static_cast<size_t>(out_shape_[0] * out_shape_[1]) * 2;
  const size_t lse_bytes = static_cast<size_t>(lse_shape_[0]) * 4;
  const TensorView out_view{v1::BF16, out_shape_,
                            absl::string_view(reinterpret_cast<const char*>(out), out_bytes)};
  const TensorView lse_view{v1::FP32, lse_shape_,
                            absl::string_view(reinterpret_cast<const char*>(lse), lse_bytes)};
  EncodeDecodeResponse(fields, &out_view, lse != nullptr ? &lse_view : nullptr, encoded);
}

}  // namespace sds::server
