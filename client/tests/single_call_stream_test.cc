// SingleCallStream (the load generator's stream) against in-process fake servers: an
// answer per call, a stream whose answers do not match its requests, and a cancel from
// another thread ending a call the server never answers.
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "bench/e2e/echo_service.h"
#include "client/decode_client.h"
#include "client/loadgen/single_call_stream.h"
#include "client/tests/test_server.h"

namespace sds::loadgen {
namespace {

namespace v1 = ::sparse_decode::v1;

constexpr client::Shape kShape{4, 2, 8};

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

class SingleCallStreamTest : public ::testing::Test {
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

TEST_F(SingleCallStreamTest, EachCallGetsItsOwnAnswer) {
  Start(/*id_offset=*/0);
  auto stream = SingleCallStream::Open(client_.get());
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (uint64_t id : {0, 0, 7, 0}) {  // 0: the stream numbers the request
    auto out = (*stream)->Call(Input(id));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->out.size(), size_t{kShape.num_q_heads} * kShape.head_dim);
  }
  EXPECT_TRUE((*stream)->status().ok());
}

TEST_F(SingleCallStreamTest, AnAnswerToAnotherRequestBreaksTheStream) {
  Start(/*id_offset=*/1);
  auto stream = SingleCallStream::Open(client_.get());
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto out = (*stream)->Call(Input(5));
  ASSERT_EQ(out.status().code(), absl::StatusCode::kInternal) << out.status();
  EXPECT_NE(out.status().message().find("answered request 6 while 5 was in flight"),
            std::string::npos)
      << out.status();
  EXPECT_EQ((*stream)->status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*stream)->Call(Input(9)).status().code(), absl::StatusCode::kInternal);
}

TEST_F(SingleCallStreamTest, CancelEndsACallThatIsNeverAnswered) {
  Start(/*id_offset=*/0, /*silent=*/true);
  auto stream = SingleCallStream::Open(client_.get());
  ASSERT_TRUE(stream.ok()) << stream.status();
  SingleCallStream* s = stream->get();
  auto call = std::async(std::launch::async, [s] { return s->Call(Input(1)); });
  ASSERT_EQ(call.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "answered by a server that never answers";
  s->Cancel();
  ASSERT_EQ(call.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(call.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s->status().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace sds::loadgen
