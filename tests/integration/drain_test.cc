// Graceful drain: on SIGTERM the server stops admitting RPCs (UNAVAILABLE), finishes
// every queued request (correct answers), closes open streams and exits 0 in time.
#include <signal.h>

#include <atomic>
#include <map>
#include <thread>

#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace sds::itest {
namespace {

TEST(Drain, QueuedWorkFinishesAndTheServerExitsZero) {
  TestModel model;
  // Batches wait up to 2 s to fill: at SIGTERM everything below is still queued.
  Harness h(model, {"--max_queue_delay_us=2000000", "--max_batch_size=64", "--drain_timeout_s=10"});
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(31);
  constexpr int kUnary = 4;
  for (int i = 0; i < kUnary; ++i) h.CreateAndPrefill(gen, "u" + std::to_string(i), 6);
  h.CreateAndPrefill(gen, "stream", 6);

  // Unary decodes, each in its own thread.
  std::atomic<int> unary_ok{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kUnary; ++i) {
    v1::DecodeRequest r =
        RandomDecode(gen, model, "u" + std::to_string(i), i % 3, 6, 5, false, i + 1);
    h.mirror().WriteDecodeToken(r);
    threads.emplace_back([&h, r, &unary_ok] {
      auto stub = h.NewStub();
      v1::DecodeResponse response;
      grpc::Status s = stub->Decode(Context().get(), r, &response);
      if (s.ok() && h.mirror().Check(r, response).empty()) unary_ok++;
    });
  }
  // A stream with three queued requests (three layers), left open.
  grpc::ClientContext context;
  auto stream = h.stub().DecodeStream(&context);
  std::map<uint64_t, v1::DecodeRequest> sent;
  for (int32_t layer = 0; layer < 3; ++layer) {
    v1::DecodeRequest r = RandomDecode(gen, model, "stream", layer, 6, 7, true, 100 + layer);
    h.mirror().WriteDecodeToken(r);
    sent[r.request_id()] = r;
    ASSERT_TRUE(stream->Write(r));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // all queued, none run

  const auto signalled = std::chrono::steady_clock::now();
  h.server().Signal(SIGTERM);
  for (auto& t : threads) t.join();
  EXPECT_EQ(unary_ok.load(), kUnary) << h.server().Log();
  v1::DecodeResponse response;
  int streamed_ok = 0;
  while (stream->Read(&response)) {
    if (sent.count(response.request_id()) &&
        h.mirror().Check(sent[response.request_id()], response).empty()) {
      ++streamed_ok;
    }
  }
  EXPECT_EQ(streamed_ok, 3);
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();

  // New RPCs are refused: "server is draining" while it drains, or no server at all.
  v1::ModelInfo info;
  auto stub = h.NewStub();
  EXPECT_EQ(stub->GetModelInfo(Context("", std::chrono::seconds(2)).get(),
                               v1::GetModelInfoRequest(), &info)
                .error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(HealthStatus(h.server().NewChannel(), ""), 1);

  EXPECT_EQ(h.server().WaitExit(std::chrono::seconds(12)), 0) << h.server().Log();
  EXPECT_LT(std::chrono::steady_clock::now() - signalled, std::chrono::seconds(11))
      << h.server().Log();
  // The queued batches did not wait out their 2 s queue delay.
  EXPECT_NE(h.server().Log().find("draining"), std::string::npos);
}

TEST(Drain, IdleServerExitsZeroOnSigint) {
  TestModel model;
  Harness h(model, {"--drain_timeout_s=5"});
  ASSERT_TRUE(h.ok()) << h.error();
  h.server().Signal(SIGINT);
  EXPECT_EQ(h.server().WaitExit(std::chrono::seconds(6)), 0) << h.server().Log();
}

}  // namespace
}  // namespace sds::itest
