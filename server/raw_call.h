// The state of one call of a method the service takes raw (as gRPC ByteBuffers). The
// other unary methods (TypedCall): the request and response, parsed and serialized
// whole by protobuf. Decode and DecodeBatch (RawCall): the received slices, the parsed
// request whose tensor data stays in those slices (wire_decode.h), and the typed
// response, both messages on one arena whose first block is sized for the model's
// tensors, with the answers the executor encodes straight from staging
// (response_wire.h). Shared by the call's completions; freed when the last one is gone.
#pragma once

#include <grpcpp/impl/codegen/proto_utils.h>  // SerializationTraits of protobuf messages
#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/message_allocator.h>

#include <climits>
#include <cstddef>
#include <exception>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/arena.h"
#include "server/response_wire.h"
#include "server/tensor_bytes.h"
#include "server/wire_decode.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

// Serializes `message` into `out` (slices that gRPC sends as they are), as a typed
// method's handler would.
inline absl::Status SerializeReply(const google::protobuf::MessageLite& message,
                                   grpc::ByteBuffer* out) {
  bool own_buffer = false;
  const grpc::Status s =
      grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::MessageLite>(message, out,
                                                                                     &own_buffer);
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cannot serialize the response: ", s.error_message()));
}

// Frees the received message of a raw unary call (`received`, the handler's request)
// now instead of when the call is done. gRPC keeps it until then, that is until the
// answer is sent: a handler that parsed it into a message of its own (TypedCall) would
// hold the request twice while it waits in the queue (2 x 128 MiB for a large prefill).
// The one mutable handle gRPC gives to it is the call's message holder
// (GetRpcAllocatorState, the MessageAllocator API), whose request() it is; the holder
// destroys it when the call is done, and a cleared ByteBuffer destroys nothing. Frees
// nothing and returns false when the holder does not hold `received` (a custom
// allocator; a gRPC that keeps the message elsewhere). After a true, `received` is
// empty: read nothing from it.
inline bool ReleaseReceived(grpc::CallbackServerContext* context,
                            const grpc::ByteBuffer* received) {
  auto* holder = dynamic_cast<grpc::MessageHolder<grpc::ByteBuffer, grpc::ByteBuffer>*>(
      context->GetRpcAllocatorState());
  if (holder == nullptr || holder->request() != received) return false;
  holder->request()->Clear();
  return true;
}

// One call of a unary method whose messages protobuf parses and serializes whole
// (GetModelInfo, CreateSequence, AppendKV, ForkSequence, ReleaseSequence), taken raw as
// well: gRPC's typed deserialisation answers a malformed message INTERNAL with an empty
// message before any handler runs, where the contract says INVALID_ARGUMENT (INTERNAL
// is a server bug), and the call would not reach the metrics. Shared by the call's
// completions; the request and response live until the last one is gone. Both on one
// arena: a DecodeLayer call of 256 items is 256 sequence ids in and 256 error messages
// out, each its own heap string on heap-allocated messages.
template <typename Request, typename Response>
struct TypedCall {
  google::protobuf::Arena arena;
  Request& request = *google::protobuf::Arena::CreateMessage<Request>(&arena);
  Response& response = *google::protobuf::Arena::CreateMessage<Response>(&arena);

  // INVALID_ARGUMENT when `received` is not a valid encoding of Request (truncated or
  // corrupted bytes, a string field that is not UTF-8). `request` keeps nothing of
  // `received` (protobuf copies the bytes fields), so it may be released after this.
  absl::Status Parse(const grpc::ByteBuffer& received) {
    grpc::ByteBuffer view(received);  // shares the slices; the reader consumes its own
    grpc::ProtoBufferReader reader(&view);
    if (!reader.status().ok() || !request.ParseFromZeroCopyStream(&reader)) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed ", request.GetTypeName(), ": not a valid protobuf encoding (",
                       received.Length(),
                       " bytes; truncated or corrupted, or a string field that is not UTF-8)"));
    }
    return absl::OkStatus();
  }

  // The reply of a call answered OK. INTERNAL when memory runs out.
  absl::Status Reply(grpc::ByteBuffer* out) {
    try {
      return SerializeReply(response, out);
    } catch (const std::exception& e) {  // bad_alloc: `done` callbacks must not throw
      return absl::InternalError(absl::StrCat("cannot build the reply: ", e.what()));
    }
  }
};

template <typename Request, typename Response>
class RawCall {
 public:
  // `first_block_bytes`: the arena's first block (later blocks grow up to 8x that).
  explicit RawCall(size_t first_block_bytes)
      : arena_(Options(first_block_bytes)),
        request_(google::protobuf::Arena::CreateMessage<Request>(&arena_)),
        response_(google::protobuf::Arena::CreateMessage<Response>(&arena_)) {}
  RawCall(const RawCall&) = delete;
  RawCall& operator=(const RawCall&) = delete;

  // Takes the received message's slices and parses it (a DecodeRequest into one
  // DecodeTensorBytes, a DecodeBatchRequest into one per request), with one answer slot
  // per request. INVALID_ARGUMENT when it is not a valid encoding, or a batch of more
  // than `max_items` requests.
  absl::Status Parse(const grpc::ByteBuffer& received, int max_items = INT_MAX) {
    if (absl::Status s = wire_.Take(received); !s.ok()) return s;
    if constexpr (kBatch) {
      absl::Status s = wire_.ParseDecodeBatch(request_, &bytes_, max_items);
      encoded_.resize(bytes_.size());
      for (EncodedResponse& e : encoded_) e.batch_item = true;
      return s;
    } else {
      bytes_.resize(1);
      encoded_.resize(1);
      return wire_.ParseDecodeRequest(request_, &bytes_[0]);
    }
  }

  // The reply of a call answered OK: the executor's encoded answer (Decode), or every
  // item's (DecodeBatch; an item answered with an error is encoded here from its typed
  // slot). INTERNAL when an answer is missing (a bug) or memory runs out.
  absl::Status Reply(grpc::ByteBuffer* out) {
    try {
      absl::StatusOr<grpc::ByteBuffer> reply;
      if constexpr (kBatch) {
        reply = DecodeBatchReply(*response_, &encoded_);
      } else {
        reply = DecodeReply(encoded_.at(0));  // Parse made the one slot
      }
      if (!reply.ok()) return reply.status();
      out->Swap(&*reply);
      return absl::OkStatus();
    } catch (const std::exception& e) {  // bad_alloc: `done` callbacks must not throw
      return absl::InternalError(absl::StrCat("cannot build the reply: ", e.what()));
    }
  }

  const Request* request() const { return request_; }
  Response* response() { return response_; }
  const DecodeTensorBytes& bytes(size_t i) const { return bytes_[i]; }
  EncodedResponse* encoded(size_t i) { return &encoded_[i]; }

 private:
  static constexpr bool kBatch = std::is_same_v<Request, sparse_decode::v1::DecodeBatchRequest>;
  static google::protobuf::ArenaOptions Options(size_t first_block) {
    google::protobuf::ArenaOptions options;
    options.start_block_size = first_block;
    options.max_block_size = first_block * 8;
    return options;
  }

  google::protobuf::Arena arena_;
  Request* request_;
  Response* response_;
  WireMessage wire_;
  std::vector<DecodeTensorBytes> bytes_;
  std::vector<EncodedResponse> encoded_;  // one per request
};

}  // namespace sds::server
