// The output half of the one-copy path (wire_decode.h is the input half): a decode's
// answer encoded straight from the staging rows into the slice gRPC sends. With a typed
// response, out and lse were copied twice on the answering thread (staging -> arena
// string by set_data, then arena -> slices by serialization); here once.
//
// The bytes are those protobuf writes for the same message (canonical field order,
// proto3 defaults omitted, packed shapes): response_wire_test compares them with
// SerializeAsString, so any client's parser reads them as before.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/model_shape.h"
#include "server/work.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

// A tensor field written from borrowed bytes: dtype, shape and data as in v1::Tensor.
struct TensorView {
  sparse_decode::v1::DType dtype = sparse_decode::v1::DTYPE_UNSPECIFIED;
  absl::Span<const int64_t> shape;
  absl::string_view data;
};

// Where the executor leaves a decode's encoded answer (DecodeWork::encoded). Empty until
// then; for an item of a DecodeBatch call (`batch_item`) the bytes are one element of
// DecodeBatchResponse.responses, field tag and length included, so that the call's
// reply is its items' slices in order.
struct EncodedResponse {
  bool batch_item = false;
  grpc::Slice bytes;
  bool empty() const { return bytes.size() == 0; }
};

// The encoding of `fields` with its `out` and `lse` replaced by the views (a null view:
// the field as `fields` has it). `fields` keeps the other fields (request_id, batch,
// error_code, error_message).
size_t DecodeResponseSize(const sparse_decode::v1::DecodeResponse& fields, const TensorView* out,
                          const TensorView* lse);
// Writes DecodeResponseSize(...) bytes at `target`; returns the end.
uint8_t* WriteDecodeResponse(const sparse_decode::v1::DecodeResponse& fields, const TensorView* out,
                             const TensorView* lse, uint8_t* target);

// Encodes into a fresh slice, framed as a DecodeBatchResponse element when
// encoded->batch_item.
void EncodeDecodeResponse(const sparse_decode::v1::DecodeResponse& fields, const TensorView* out,
                          const TensorView* lse, EncodedResponse* encoded);

// A decode item's answer as the bytes path sends it (DecodeSink::Write of Decode,
// DecodeBatch and DecodeStream): request_id, the batch's BatchInfo, out [Hq, D] bf16 and,
// when `lse` is not null, lse [Hq] f32, read straight from the executor's rows.
class AnswerEncoder {
 public:
  explicit AnswerEncoder(const ModelShape& model)
      : out_shape_{model.num_q_heads, model.head_dim}, lse_shape_{model.num_q_heads} {}
  void Encode(uint64_t request_id, const BatchInfo& batch, const uint16_t* out, const float* lse,
              EncodedResponse* encoded) const;

 private:
  int64_t out_shape_[2];  // [Hq, D]
  int64_t lse_shape_[1];  // [Hq]
};

// The reply of one decode answered OK (a Decode call, a DecodeStream message): the
// executor's encoded answer, referenced, not copied. INTERNAL when there is none (a bug:
// it would go out without its tensors).
absl::StatusOr<grpc::ByteBuffer> DecodeReply(const EncodedResponse& encoded);

// The reply of a DecodeBatch call: element i is encoded[i] where the executor filled it,
// else responses(i) of `typed` encoded now (an item answered with an error). The reply
// references the slices, it does not copy them. INTERNAL when an item has neither (a
// bug: it would go out without its tensors).
absl::StatusOr<grpc::ByteBuffer> DecodeBatchReply(
    const sparse_decode::v1::DecodeBatchResponse& typed, std::vector<EncodedResponse>* encoded);

}  // namespace sds::server
