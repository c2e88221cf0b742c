// Graceful drain (DESIGN.md; server/README.md, "Draining"): on SIGTERM/SIGINT the server
// turns NOT_SERVING, answers new RPCs UNAVAILABLE, finishes every queued request (correct
// answers) without waiting for the queue delay, closes open streams with UNAVAILABLE and
// exits 0 within --drain_timeout_s.
//
// Nothing here depends on how fast this machine is: queued work is seen in the server's
// queue-depth gauge instead of slept for, the queue delay is longer than the whole drain
// budget (so only the drain can run that work in time), and the probes of the draining
// server are sent while --drain_linger_ms keeps its port open.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace sds::itest {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using std::chrono::steady_clock;

// Beyond the drain budget: the process's own exit and WaitExit's polling.
constexpr milliseconds kExitSlack{500};

// Waits until the server's batcher holds exactly `items` queued items (sds_queue_depth).
::testing::AssertionResult WaitForQueueDepth(const ServerProcess& server, int items) {
  const std::string want = absl::StrCat("\nsds_queue_depth ", items, "\n");
  const auto give_up = steady_clock::now() + seconds(30);
  std::string body;
  while (steady_clock::now() < give_up) {
    int status = 0;
    body = HttpGet(server.metrics_port(), "/metrics", &status);
    if (status == 200 && body.find(want) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  return ::testing::AssertionFailure() << "queue depth never reached " << items << ":\n" << body;
}

// Exit status 0 within `budget` (+ kExitSlack) of the signal; prints the time taken.
void ExpectExitWithin(ServerProcess& server, steady_clock::time_point signalled, seconds budget) {
  EXPECT_EQ(server.WaitExit(budget + seconds(5)), 0) << server.Log();
  const auto took = std::chrono::duration_cast<milliseconds>(steady_clock::now() - signalled);
  std::printf("signal to exit: %lld ms (budget %lld s)\n", static_cast<long long>(took.count()),
              static_cast<long long>(budget.count()));
  EXPECT_LT(took, budget + kExitSlack) << server.Log();
}

TEST(Drain, QueuedWorkFinishesAndTheServerExitsZero) {
  TestModel model;
  constexpr seconds kBudget{5};
  // The linger is the window for the probes after the streams closed; they are sent
  // within milliseconds, so 2 s is a wide margin even on a loaded machine.
  Harness h(model, {"--max_queue_delay_us=60000000", "--max_batch_size=64",
                    absl::StrCat("--drain_timeout_s=", kBudget.count()), "--drain_linger_ms=2000"});
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(31);
  constexpr int kUnary = 4;
  for (int i = 0; i < kUnary; ++i) h.CreateAndPrefill(gen, absl::StrCat("u", i), 6);
  h.CreateAndPrefill(gen, "stream", 6);

  // Unary decodes, each in its own thread.
  std::atomic<int> unary_ok{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kUnary; ++i) {
    v1::DecodeRequest r = RandomDecode(gen, model, absl::StrCat("u", i), i % 3, 6, 5, false, i + 1);
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
  // All seven queued; none can run before the 60 s queue delay, except by the drain.
  ASSERT_TRUE(WaitForQueueDepth(h.server(), kUnary + 3));

  const auto signalled = steady_clock::now();
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

  // New RPCs are refused by the draining server itself (its port is still open).
  v1::ModelInfo info;
  auto stub = h.NewStub();
  s = stub->GetModelInfo(Context("", seconds(2)).get(), v1::GetModelInfoRequest(), &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("server is draining"), std::string::npos)
      << s.error_message() << "\n"
      << h.server().Log();
  EXPECT_EQ(HealthStatus(h.server().NewChannel(), ""), 2);  // NOT_SERVING

  ExpectExitWithin(h.server(), signalled, kBudget);
}

TEST(Drain, IdleServerExitsZeroOnSigintWithinItsBudget) {
  TestModel model;
  // A budget of 1 s: an exit that waits out a poll timeout of its own (civetweb's 2 s
  // accept poll did) overruns it.
  constexpr seconds kBudget{1};
  Harness h(model, {absl::StrCat("--drain_timeout_s=", kBudget.count())});
  ASSERT_TRUE(h.ok()) << h.error();
  const auto signalled = steady_clock::now();
  h.server().Signal(SIGINT);
  ExpectExitWithin(h.server(), signalled, kBudget);
}

}  // namespace
}  // namespace sds::itest
