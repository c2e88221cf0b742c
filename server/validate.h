// Request validation that needs no cache state: dtypes, shapes, byte sizes, layer
// range, top-K, index ranges and NaN/Inf. Runs before anything is queued; every
// error is INVALID_ARGUMENT with a message naming the field.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/model_shape.h"
#include "server/tensor_bytes.h"
#include "server/work.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

absl::Status ValidateSequenceId(absl::string_view id, const char* field);
// A decode item's sequence id, layer and position (in [0, 2^31)).
absl::Status CheckItemFields(absl::string_view sequence_id, int32_t layer, int64_t position,
                             const ModelShape& model);

// "[2, 3]": a shape as the error messages print it.
std::string ShapeText(absl::Span<const int64_t> shape);
// The dtype's name, or its number when the contract has no such value (a newer or a
// broken client): DType_Name gives an empty string for those.
std::string DTypeText(sparse_decode::v1::DType dtype);
// Views of a request's own data fields (the request must outlive them).
DecodeTensorBytes DecodeBytesOf(const sparse_decode::v1::DecodeRequest& request);
// Checks a decode request whose tensor data is at `bytes` (its own fields, or the wire
// slices of a raw call, whose message fields then hold no data), and describes it in
// `item` for the batcher: every field but index, key and incarnation; item->bytes =
// `bytes`, so the data must outlive the item.
absl::Status ValidateDecode(const sparse_decode::v1::DecodeRequest& request,
                            const DecodeTensorBytes& bytes, const ModelShape& model,
                            DecodeItem* item);
// The same with the data in the request's own fields, the item thrown away (tests).
absl::Status ValidateDecode(const sparse_decode::v1::DecodeRequest& request,
                            const ModelShape& model);
// The value checks of an item whose shapes are checked: q, gate, k and v finite, each
// index -1 or in [0, position]. Nothing for an item whose tensors are on the device (the
// backend checks those).
absl::Status CheckDecodeValues(const DecodeItem& item);
absl::Status ValidateAppend(const sparse_decode::v1::AppendKVRequest& request,
                            const ModelShape& model);

// True when none of the n bf16 values at `bytes` ([n] bf16 bits, any alignment) is NaN
// or Inf (all exponent bits set). Branch-free: every request's q, gate, k and v pass
// through it.
bool AllFiniteBf16(const char* bytes, int64_t n);

}  // namespace sds::server
