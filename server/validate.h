// Request validation that needs no cache state: dtypes, shapes, byte sizes, layer
// range, top-K, index ranges and NaN/Inf. Runs before anything is queued; every
// error is INVALID_ARGUMENT with a message naming the field.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/model_shape.h"
#include "server/tensor_bytes.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

absl::Status ValidateSequenceId(const std::string& id, const char* field);

// "[2, 3]": a shape as the error messages print it.
std::string ShapeText(absl::Span<const int64_t> shape);
// The dtype's name, or its number when the contract has no such value (a newer or a
// broken client): DType_Name gives an empty string for those.
std::string DTypeText(sparse_decode::v1::DType dtype);
// `bytes`: the request's tensor data (its own fields, or the wire slices of a raw call,
// whose message fields then hold no data).
absl::Status ValidateDecode(const sparse_decode::v1::DecodeRequest& request,
                            const DecodeTensorBytes& bytes, const ModelShape& model);
// The same with the data in the request's own fields.
absl::Status ValidateDecode(const sparse_decode::v1::DecodeRequest& request,
                            const ModelShape& model);
absl::Status ValidateAppend(const sparse_decode::v1::AppendKVRequest& request,
                            const ModelShape& model);

// True when none of the n bf16 values at `bytes` ([n] bf16 bits, any alignment) is NaN
// or Inf (all exponent bits set). Branch-free: every request's q, gate, k and v pass
// through it.
bool AllFiniteBf16(const char* bytes, int64_t n);

// True when the index list is [Hkv, K] (one list per KV head) rather than [K].
// Only meaningful after ValidateDecode succeeded.
inline bool IndicesPerKvHead(const sparse_decode::v1::Tensor& indices) {
  return indices.shape_size() == 2;
}

}  // namespace sds::server
