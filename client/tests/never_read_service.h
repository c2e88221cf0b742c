// A fake DecodeService shared by the client and loadgen runner tests.
#pragma once

#include <grpcpp/grpcpp.h>

#include "sparse_decode/v1/decode.grpc.pb.h"

namespace sds::client_test {

// Accepts DecodeStream calls and never reads them: once the stream's flow-control window
// is full, the client's Write blocks, and nothing but a cancel ends it. (Started with
// small windows: gRPC's defaults let several MB through first.)
class NeverReadService final : public ::sparse_decode::v1::DecodeService::CallbackService {
  using Request = ::sparse_decode::v1::DecodeRequest;
  using Response = ::sparse_decode::v1::DecodeResponse;

  class Stuck final : public grpc::ServerBidiReactor<Request, Response> {
   public:
    void OnCancel() override { Finish(grpc::Status::CANCELLED); }
    void OnDone() override { delete this; }
  };

 public:
  grpc::ServerBidiReactor<Request, Response>* DecodeStream(grpc::CallbackServerContext*) override {
    return new Stuck();
  }
};

}  // namespace sds::client_test
