// The load generator's stream tests' fake server (an echo that can answer under the
// wrong id, or never) and fixture, shared by single_call_stream_test.cc and
// reactor_stream_test.cc.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "bench/e2e/echo_service.h"
#include "client/decode_client.h"
#include "client/tests/test_server.h"

namespace sds::loadgen {

namespace v1 = ::sparse_decode::v1;

inline constexpr client::Shape kShape{4, 2, 8};

// Answers every DecodeStream request like the echo server, under `id_offset` + its id;
// with `silent`, reads requests and never answers.
class StreamService final : public v1::DecodeService::CallbackService {
  class Reactor final : public grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse> {
   public:
    explicit Reactor(const StreamService* service) : service_(service) { StartRead(&request_); }
    void OnReadDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::OK);
      if (service_->silent_) return StartRead(&request_);
      service_->echo_.Answer(request_, 1, 1, &response_);
      response_.set_request_id(request_.request_id() + service_->id_offset_);
      StartWrite(&response_);
    }
    void OnWriteDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::CANCELLED);
      StartRead(&request_);
    }
    void OnCancel() override {}
    void OnDone() override { delete this; }

   private:
    const StreamService* service_;
    v1::DecodeRequest request_;
    v1::DecodeResponse response_;
  };

 public:
  StreamService(uint64_t id_offset, bool silent)
      : echo_(client_test::ModelInfoOf(kShape, 1)), id_offset_(id_offset), silent_(silent) {}
  grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* DecodeStream(
      grpc::CallbackServerContext*) override {
    return new Reactor(this);
  }

 private:
  bench::EchoService echo_;
  uint64_t id_offset_;
  bool silent_;
};

// The stream tests' fixture: one StreamService, its server and a client.
class StreamTestBase : public ::testing::Test {
 protected:
  void Start(uint64_t id_offset, bool silent = false) {
    service_ = std::make_unique<StreamService>(id_offset, silent);
    std::string target;
    server_ = client_test::StartTestServer(service_.get(), &target);
    ASSERT_NE(server_, nullptr);
    client_ = client::DecodeClient::Connect(target);
    client_->SetShape(kShape);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  static client::DecodeInput Input(uint64_t request_id) {
    client::DecodeInput in;
    in.sequence_id = "s";
    in.position = 3;
    in.request_id = request_id;
    const size_t q = size_t{kShape.num_q_heads} * kShape.head_dim;
    const size_t kv = size_t{kShape.num_kv_heads} * kShape.head_dim;
    in.q.assign(q, 0x3F80);
    in.gate.assign(q, 0x3F80);
    in.k.assign(kv, 0x3F80);
    in.v.assign(kv, 0x3F80);
    in.indices = {0, 1, 2};
    return in;
  }

  std::unique_ptr<StreamService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<client::DecodeClient> client_;
};

}  // namespace sds::loadgen
