// Per-call protobuf arenas for the callback API's unary methods
// (`SetMessageAllocatorFor_<Method>`): the request is parsed into, and the response
// built in, one arena whose first block is sized for the model's tensors, so a call
// costs one or two heap allocations instead of one per Tensor, shape list and byte
// string (about 15 per decode request), and all of it is freed at once.
#pragma once

#include <grpcpp/support/message_allocator.h>

#include <cstddef>

#include "google/protobuf/arena.h"

namespace sds::server {

template <typename Request, typename Response>
class ArenaMessageAllocator final : public grpc::MessageAllocator<Request, Response> {
 public:
  // `first_block_bytes`: the arena's first block (later blocks grow up to 8x that).
  explicit ArenaMessageAllocator(size_t first_block_bytes) : first_block_(first_block_bytes) {}

  grpc::MessageHolder<Request, Response>* AllocateMessages() override {
    return new Holder(first_block_);
  }

 private:
  class Holder final : public grpc::MessageHolder<Request, Response> {
   public:
    explicit Holder(size_t first_block) : arena_(Options(first_block)) {
      this->set_request(google::protobuf::Arena::CreateMessage<Request>(&arena_));
      this->set_response(google::protobuf::Arena::CreateMessage<Response>(&arena_));
    }
    void Release() override { delete this; }

   private:
    static google::protobuf::ArenaOptions Options(size_t first_block) {
      google::protobuf::ArenaOptions options;
      options.start_block_size = first_block;
      options.max_block_size = first_block * 8;
      return options;
    }
    google::protobuf::Arena arena_;
  };

  const size_t first_block_;
};

}  // namespace sds::server
