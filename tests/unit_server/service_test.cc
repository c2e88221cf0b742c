// DecodeServiceImpl in process (CPU backend, real batcher), for what only a gRPC call
// shows: how long the service holds the bytes it received.
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "server/batcher.h"
#include "server/service.h"
#include "sparse_decode/v1/decode.grpc.pb.h"
#include "tests/unit_server/cpu_stack.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;
namespace exp = grpc::experimental;

// Per method: the size of the received message still held by gRPC's call when the
// server sends the call's status (the call's last step before it is done).
struct HeldAtStatus {
  std::mutex mu;
  std::map<std::string, size_t> bytes;
};

class HeldWatcher final : public exp::Interceptor {
 public:
  HeldWatcher(exp::ServerRpcInfo* info, HeldAtStatus* held)
      : method_(info->method()), held_(held) {}

  void Intercept(exp::InterceptorBatchMethods* methods) override {
    // For a raw method the received message is the ByteBuffer the handler gets.
    if (methods->QueryInterceptionHookPoint(exp::InterceptionHookPoints::POST_RECV_MESSAGE)) {
      received_ = static_cast<const grpc::ByteBuffer*>(methods->GetRecvMessage());
    }
    if (methods->QueryInterceptionHookPoint(exp::InterceptionHookPoints::PRE_SEND_STATUS) &&
        received_ != nullptr) {
      std::lock_guard<std::mutex> lock(held_->mu);
      held_->bytes[method_] = received_->Length();
    }
    methods->Proceed();
  }

 private:
  std::string method_;
  HeldAtStatus* held_;
  const grpc::ByteBuffer* received_ = nullptr;
};

class HeldWatcherFactory final : public exp::ServerInterceptorFactoryInterface {
 public:
  explicit HeldWatcherFactory(HeldAtStatus* held) : held_(held) {}
  exp::Interceptor* CreateServerInterceptor(exp::ServerRpcInfo* info) override {
    return new HeldWatcher(info, held_);
  }

 private:
  HeldAtStatus* held_;
};

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status built = stack_.Init();
    ASSERT_TRUE(built.ok()) << built;
    BatcherOptions options;
    options.max_batch_size = stack_.config.max_batch_size;
    batcher_ = std::make_unique<Batcher>(options, stack_.executor.get(), stack_.TakeStaging());
    batcher_->Start();
    ServiceConfig service_config;
    service_config.model = stack_.model;
    service_config.info.set_page_size(stack_.config.cache.page_size);
    service_ = std::make_unique<DecodeServiceImpl>(service_config, stack_.backend.get(),
                                                   batcher_.get(), stack_.metrics.get());

    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    std::vector<std::unique_ptr<exp::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<HeldWatcherFactory>(&held_));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::DecodeService::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (batcher_) batcher_->Stop();
  }

  size_t HeldBy(const std::string& method) {
    std::lock_guard<std::mutex> lock(held_.mu);
    auto it = held_.bytes.find("/sparse_decode.v1.DecodeService/" + method);
    EXPECT_NE(it, held_.bytes.end()) << method << " was not seen by the interceptor";
    return it == held_.bytes.end() ? 0 : it->second;
  }

  HeldAtStatus held_;
  server_test::CpuStack stack_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<DecodeServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
};

// A prefill waits in the queue holding its parsed request; the received bytes (as large
// again) are freed before that, not when the call ends. The append still lands: the
// parsed request owns its data.
TEST_F(ServiceTest, TypedCallsFreeTheReceivedBytesOnceParsed) {
  {
    grpc::ClientContext context;
    v1::CreateSequenceRequest request;
    request.set_sequence_id("s");
    v1::CreateSequenceResponse response;
    const grpc::Status s = stub_->CreateSequence(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  constexpr int64_t kTokens = 32;
  grpc::ClientContext context;
  v1::AppendKVRequest request;
  request.set_sequence_id("s");
  for (v1::Tensor* t : {request.mutable_k(), request.mutable_v()}) {
    t->set_dtype(v1::BF16);
    for (int64_t dim : {kTokens, int64_t{1}, int64_t{64}}) t->add_shape(dim);
    t->set_data(std::string(kTokens * 64 * 2, '\0'));
  }
  v1::AppendKVResponse response;
  const grpc::Status s = stub_->AppendKV(&context, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.length(), kTokens);
  EXPECT_EQ(HeldBy("AppendKV"), 0u);
  EXPECT_EQ(HeldBy("CreateSequence"), 0u);
}

}  // namespace
}  // namespace sds::server
