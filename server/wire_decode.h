// Parses DecodeRequest and DecodeBatchRequest straight from a received gRPC message
// (the service's raw Decode and DecodeBatch methods). Every field except the tensors'
// `data` is parsed into the message as protobuf would parse it; each tensor's data stays
// in the message's slices, described by a TensorBytes view. So the bytes of q, k, v, gate
// and indices are copied once, from the wire into the staging buffer, where a typed
// method copies them into protobuf strings first (about 22 KB per seed-shape request).
// Protobuf's CodedInputStream reads the varints, limits and unknown fields; this file
// only walks the two message types.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "server/tensor_bytes.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

class WireMessage {
 public:
  // Takes references to `buffer`'s slices (no copy of their bytes); the views that the
  // Parse methods return stay valid while this object lives.
  absl::Status Take(const grpc::ByteBuffer& buffer);
  void Clear() { slices_.clear(); }  // drops the slices (the views become invalid)
  size_t size() const;

  // Parse this message as one DecodeRequest: fields into `request` (tensor data left
  // empty), tensor data as views into `bytes`. A malformed message is INVALID_ARGUMENT.
  absl::Status ParseDecodeRequest(sparse_decode::v1::DecodeRequest* request,
                                  DecodeTensorBytes* bytes) const;
  // The same for a DecodeBatchRequest: (*bytes)[i] belongs to batch->requests(i).
  // INVALID_ARGUMENT, before anything is allocated for it, at an item past `max_items`:
  // a message of empty items costs two bytes on the wire and ~700 bytes each here.
  absl::Status ParseDecodeBatch(sparse_decode::v1::DecodeBatchRequest* batch,
                                std::vector<DecodeTensorBytes>* bytes, int max_items) const;

 private:
  std::vector<grpc::Slice> slices_;
};

}  // namespace sds::server
