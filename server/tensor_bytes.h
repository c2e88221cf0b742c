// Where a request's tensor bytes are, without owning them. Decode, DecodeBatch and
// DecodeStream keep their tensors in the received gRPC slices (wire_decode.h): one
// tensor may be split over several slices, at any byte (an element can straddle two of
// them). The start-up self-test and the unit tests keep them in protobuf strings: one
// piece. Validation reads the pieces in place and the staging copy is the one copy of
// each byte between the wire and the backend.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "absl/container/inlined_vector.h"
#include "kernels/decode_params.h"

namespace sds::server {

class TensorBytes {
 public:
  TensorBytes() = default;
  // One piece: the bytes of `data`, which must outlive this view.
  static TensorBytes Of(const std::string& data) {
    TensorBytes bytes;
    bytes.Append(data.data(), data.size());
    return bytes;
  }

  void Append(const char* data, size_t size) {
    if (size == 0) return;
    pieces_.push_back({data, size});
    size_ += size;
  }
  void Clear() {
    pieces_.clear();
    size_ = 0;
  }
  size_t size() const { return size_; }
  size_t num_pieces() const { return pieces_.size(); }

  // Copies all size() bytes to `dst`.
  void CopyTo(void* dst) const {
    char* out = static_cast<char*>(dst);
    for (const Piece& p : pieces_) {
      std::memcpy(out, p.data, p.size);
      out += p.size;
    }
  }

  // Calls fn(const char* run, int64_t count, int64_t first) for consecutive runs of
  // whole elements of `element_bytes` each, in order: `run` holds elements [first,
  // first + count) contiguously (any alignment). An element split between two pieces is
  // assembled into a local buffer and passed as a run of one. Bytes after the last whole
  // element are not visited (callers check size() first).
  template <typename Fn>
  void ForEachElementRun(size_t element_bytes, Fn&& fn) const {
    char partial[16];  // element_bytes <= 16
    size_t partial_bytes = 0;
    int64_t next = 0;  // index of the next element to visit
    for (const Piece& p : pieces_) {
      const char* at = p.data;
      size_t left = p.size;
      if (partial_bytes > 0) {  // finish the element split at the piece boundary
        const size_t take = std::min(left, element_bytes - partial_bytes);
        std::memcpy(partial + partial_bytes, at, take);
        partial_bytes += take;
        at += take;
        left -= take;
        if (partial_bytes < element_bytes) continue;
        fn(static_cast<const char*>(partial), int64_t{1}, next++);
        partial_bytes = 0;
      }
      const int64_t whole = static_cast<int64_t>(left / element_bytes);
      if (whole > 0) fn(at, whole, next);
      next += whole;
      partial_bytes = left - static_cast<size_t>(whole) * element_bytes;
      std::memcpy(partial, at + static_cast<size_t>(whole) * element_bytes, partial_bytes);
    }
  }

 private:
  struct Piece {
    const char* data;
    size_t size;
  };
  absl::InlinedVector<Piece, 2> pieces_;
  size_t size_ = 0;
};

// The tensor bytes of one DecodeRequest (shapes and dtypes stay in the message).
struct DecodeTensorBytes {
  TensorBytes q, k, v, gate, indices;
  // Non-null when the tensors are in device memory instead (a DecodeLayer item with CUDA
  // region refs): the views above are empty, the backend reads and checks the data.
  const DeviceRowSource* device = nullptr;
  int64_t device_index_count = 0;  // the request's indices (K or Hkv * K), when `device`

  // Every view empty. (Assigning `{}` instead makes GCC 12 warn about the inlined
  // storage of the temporary, a false -Wuninitialized.)
  void Clear() {
    for (TensorBytes* t : {&q, &k, &v, &gate, &indices}) t->Clear();
    device = nullptr;
    device_index_count = 0;
  }
};

}  // namespace sds::server
