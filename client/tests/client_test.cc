// sds_client against an in-process echo DecodeService, and its tensor codec.
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "bench/e2e/echo_service.h"
#include "client/decode_client.h"
#include "client/tests/never_read_service.h"
#include "client/tests/test_server.h"

namespace sds::client {
namespace {

constexpr Shape kShape{8, 2, 16};

DecodeInput Input(uint64_t request_id = 0) {
  DecodeInput in;
  in.sequence_id = "s";
  in.position = 5;
  in.q.assign(8 * 16, 0x3f80);
  in.gate.assign(8 * 16, 0x3f80);
  in.k.assign(2 * 16, 0x3f80);
  in.v.assign(2 * 16, 0x3f80);
  in.indices = {0, 1, -1, 5};
  in.request_id = request_id;
  return in;
}

TEST(TensorCodec, BuildsShapedTensors) {
  auto req = BuildDecodeRequest(Input(7), kShape);
  ASSERT_TRUE(req.ok()) << req.status();
  EXPECT_EQ(req->request_id(), 7u);
  EXPECT_EQ(req->q().dtype(), v1::BF16);
  EXPECT_EQ(req->q().shape_size(), 2);
  EXPECT_EQ(req->q().data().size(), 8u * 16 * 2);
  EXPECT_EQ(req->k().shape(0), 2);
  EXPECT_EQ(req->indices().dtype(), v1::INT32);
  ASSERT_EQ(req->indices().shape_size(), 1);
  EXPECT_EQ(req->indices().shape(0), 4);

  DecodeInput per_head = Input();
  per_head.per_kv_head_indices = true;
  req = BuildDecodeRequest(per_head, kShape);
  ASSERT_TRUE(req.ok());
  ASSERT_EQ(req->indices().shape_size(), 2);
  EXPECT_EQ(req->indices().shape(0), 2);
  EXPECT_EQ(req->indices().shape(1), 2);
}

TEST(TensorCodec, RejectsWrongSizes) {
  DecodeInput in = Input();
  in.q.pop_back();
  EXPECT_EQ(BuildDecodeRequest(in, kShape).status().code(), absl::StatusCode::kInvalidArgument);
  in = Input();
  in.per_kv_head_indices = true;
  in.indices = {1, 2, 3};
  EXPECT_EQ(BuildDecodeRequest(in, kShape).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorCodec, ParsesErrorsAndLse) {
  v1::DecodeResponse resp;
  resp.set_error_code(static_cast<int>(grpc::StatusCode::NOT_FOUND));
  resp.set_error_message("no such sequence");
  auto out = ParseDecodeResponse(resp);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(out.status().message(), "no such sequence");

  resp.Clear();
  resp.mutable_out()->set_dtype(v1::BF16);
  resp.mutable_out()->set_data(std::string(4, '\x01'));
  resp.mutable_lse()->set_dtype(v1::FP32);
  const float lse[2] = {1.5f, -2.0f};
  resp.mutable_lse()->set_data(reinterpret_cast<const char*>(lse), sizeof(lse));
  resp.mutable_batch()->set_queue_us(12);
  out = ParseDecodeResponse(resp);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->out, (std::vector<uint16_t>{0x0101, 0x0101}));
  EXPECT_EQ(out->lse, (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(out->batch.queue_us, 12);
}

class EchoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<bench::EchoService>(client_test::ModelInfoOf(kShape, 2));
    std::string target;
    server_ = client_test::StartTestServer(service_.get(), &target);
    ASSERT_NE(server_, nullptr);
    ClientOptions opts;
    opts.tenant_id = "tenant-a";
    opts.bearer_token = "secret";
    client_ = DecodeClient::Connect(target, opts);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  std::unique_ptr<bench::EchoService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<DecodeClient> client_;
};

TEST_F(EchoTest, UnaryAndBatch) {
  auto shape = client_->GetShape();
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->head_dim, 16);
  auto len = client_->AppendKV("s", 0, 3, std::vector<uint16_t>(2 * 2 * 16),
                               std::vector<uint16_t>(2 * 2 * 16));
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, 5);
  EXPECT_EQ(client_->AppendKV("s", 0, 0, std::vector<uint16_t>(3), std::vector<uint16_t>(3))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);

  DecodeInput in = Input(3);
  in.return_lse = true;
  auto out = client_->Decode(in);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->request_id, 3u);
  EXPECT_EQ(out->out.size(), 8u * 16);
  EXPECT_EQ(out->lse.size(), 8u);

  auto batch = client_->DecodeBatch({Input(1), Input(2), Input(3)});
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(batch->size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE((*batch)[i].ok());
    EXPECT_EQ((*batch)[i]->request_id, i + 1);
    EXPECT_EQ((*batch)[i]->batch.batch_size, 3);
  }
}

TEST_F(EchoTest, StreamReceivesByRequestId) {
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) {
    auto id = (*stream)->Send(Input());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  // Distinct ids, received in reverse order.
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    auto out = (*stream)->Receive(*it, std::chrono::seconds(5));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->request_id, *it);
  }
  auto missing = (*stream)->Receive(999, std::chrono::milliseconds(50));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE((*stream)->Close().ok());
  EXPECT_FALSE((*stream)->Send(Input()).ok());
}

// Records the metadata of GetModelInfo calls.
class MetadataService final : public v1::DecodeService::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx,
                                         const v1::GetModelInfoRequest*, v1::ModelInfo*) override {
    for (const auto& [key, value] : ctx->client_metadata()) {
      seen[std::string(key.data(), key.size())] = std::string(value.data(), value.size());
    }
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
  std::map<std::string, std::string> seen;
};

TEST(Metadata, TenantAndBearerAreSent) {
  MetadataService service;
  std::string target;
  auto server = client_test::StartTestServer(&service, &target);
  ASSERT_NE(server, nullptr);
  ClientOptions opts;
  opts.tenant_id = "tenant-a";
  opts.bearer_token = "secret";
  auto client = DecodeClient::Connect(target, opts);
  ASSERT_TRUE(client->GetModelInfo().ok());
  EXPECT_EQ(service.seen["x-tenant-id"], "tenant-a");
  EXPECT_EQ(service.seen["authorization"], "Bearer secret");
  server->Shutdown(std::chrono::system_clock::now());
}

TEST(Deadlines, CancelEndsASendBlockedInWrite) {
  client_test::NeverReadService service;
  std::string target;
  // Small windows: the Write below blocks.
  auto server =
      client_test::StartTestServer(&service, &target, client_test::SmallFlowControlWindows);
  ASSERT_NE(server, nullptr);
  auto client = DecodeClient::Connect(target);
  const Shape big{32, 4, 1024};  // ~150 KB requests
  client->SetShape(big);
  DecodeInput in;
  in.sequence_id = "s";
  in.q.assign(32 * 1024, 0x3f80);
  in.gate = in.q;
  in.k.assign(4 * 1024, 0);
  in.v = in.k;
  in.indices = {0};
  auto stream = client->OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto sent = std::async(std::launch::async, [&] { return (*stream)->Send(in); });
  ASSERT_EQ(sent.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the Send did not block: the test does not test anything";
  (*stream)->Cancel();
  if (sent.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "Cancel() did not end the blocked Send";
    server->Shutdown(std::chrono::system_clock::now());  // frees it
  }
  EXPECT_EQ(sent.get().status().code(), absl::StatusCode::kCancelled);
  server->Shutdown(std::chrono::system_clock::now());
}

TEST(Deadlines, UnreachableServerFailsWithinTheDeadline) {
  ClientOptions opts;
  opts.timeout = std::chrono::milliseconds(200);
  auto client = DecodeClient::Connect("127.0.0.1:1", opts);
  const auto start = std::chrono::steady_clock::now();
  auto info = client->GetModelInfo({std::nullopt, /*wait_for_ready=*/true});
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(elapsed, std::chrono::seconds(2));
}

}  // namespace
}  // namespace sds::client
