// decode_loadgen's Runner against in-process fake servers: what it counts as an error,
// and that stopping cannot hang on a stream the server does not read.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "bench/e2e/echo_service.h"
#include "client/decode_client.h"
#include "client/loadgen/runner.h"
#include "client/loadgen/workload.h"
#include "client/tests/never_read_service.h"
#include "client/tests/test_server.h"

namespace sds::loadgen {
namespace {

namespace v1 = ::sparse_decode::v1;
using Clock = std::chrono::steady_clock;

v1::ModelInfo Info(const client::Shape& shape) { return client_test::ModelInfoOf(shape, 2); }

// Decode fails (UNAVAILABLE) during the first `fail_for` after the first call, then
// answers like the echo server; DecodeBatch always fails as a whole.
class FlakyService final : public v1::DecodeService::CallbackService {
 public:
  FlakyService(const v1::ModelInfo& info, Clock::duration fail_for)
      : echo_(info), fail_for_(fail_for) {}

  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* ctx, const v1::DecodeRequest* req,
                                   v1::DecodeResponse* resp) override {
    auto* r = ctx->DefaultReactor();
    const auto now = Clock::now();
    int64_t first = 0;
    first_call_ns_.compare_exchange_strong(first, now.time_since_epoch().count());
    const auto since_first = now - Clock::time_point(Clock::duration(first_call_ns_.load()));
    if (since_first < fail_for_) {
      ++failed_;
      r->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "warming up"));
    } else {
      echo_.Answer(*req, 1, 1, resp);
      r->Finish(grpc::Status::OK);
    }
    return r;
  }
  grpc::ServerUnaryReactor* DecodeBatch(grpc::CallbackServerContext* ctx,
                                        const v1::DecodeBatchRequest*,
                                        v1::DecodeBatchResponse*) override {
    ++batch_calls_;
    auto* r = ctx->DefaultReactor();
    r->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "batch refused"));
    return r;
  }

  std::atomic<int64_t> failed_{0}, batch_calls_{0};

 private:
  bench::EchoService echo_;
  Clock::duration fail_for_;
  std::atomic<int64_t> first_call_ns_{0};
};

// The echo server, counting the DecodeStream calls opened.
class CountingEchoService final : public v1::DecodeService::CallbackService {
 public:
  explicit CountingEchoService(const v1::ModelInfo& info) : echo_(info) {}
  grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* DecodeStream(
      grpc::CallbackServerContext* ctx) override {
    ++streams_;
    return echo_.DecodeStream(ctx);
  }

  std::atomic<int64_t> streams_{0};

 private:
  bench::EchoService echo_;
};

class RunnerTest : public ::testing::Test {
 protected:
  void Start(grpc::Service* service, const client::Shape& shape, bool small_windows = false) {
    server_ =
        client_test::StartTestServer(service, &config_.target,
                                     small_windows ? client_test::SmallFlowControlWindows
                                                   : std::function<void(grpc::ServerBuilder&)>{});
    ASSERT_NE(server_, nullptr);
    config_.prefill_len = 64;
    config_.topk = 64;
    config_.stall_s = 60;  // these tests look at what is counted, not at the abort
    clients_.push_back(client::DecodeClient::Connect(config_.target));
    clients_[0]->SetShape(shape);
    workload_ = std::make_unique<Workload>(config_, shape, 2);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  // Runs the Runner; a run that has not returned after `limit` fails the test, and the
  // server's shutdown (which cancels its calls) then frees it.
  RunResult RunWithin(std::chrono::seconds limit, Clock::duration* took,
                      std::function<void()> after_stream_call = nullptr) {
    Runner runner(config_, clients_, *workload_);
    runner.SetAfterStreamCallForTest(std::move(after_stream_call));
    const auto start = Clock::now();
    auto result = std::async(std::launch::async, [&runner] { return runner.Run(); });
    if (result.wait_for(limit) != std::future_status::ready) {
      ADD_FAILURE() << "Runner::Run did not return within " << limit.count() << " s";
      server_->Shutdown(std::chrono::system_clock::now());
    }
    RunResult r = result.get();
    *took = Clock::now() - start;
    return r;
  }

  Config config_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<std::unique_ptr<client::DecodeClient>> clients_;
  std::unique_ptr<Workload> workload_;
};

// The stream tests run with each stream API: a thread per stream (sync) and none
// (callback).
class StreamRunnerTest : public RunnerTest, public ::testing::WithParamInterface<StreamApi> {
 protected:
  void StreamMode() {
    config_.mode = Mode::kStream;
    config_.mode_name = "stream";
    config_.stream_api = GetParam();
  }
};
INSTANTIATE_TEST_SUITE_P(Apis, StreamRunnerTest,
                         ::testing::Values(StreamApi::kSync, StreamApi::kCallback),
                         [](const ::testing::TestParamInfo<StreamApi>& i) {
                           return i.param == StreamApi::kSync ? "Sync" : "Callback";
                         });

TEST_P(StreamRunnerTest, StreamBlockedInWriteIsCancelledAndTheRunEnds) {
  // [32, 1024] bf16 q and gate: ~150 KB requests, more than the 64 KiB a stream may send
  // before its server reads.
  const client::Shape shape{32, 4, 1024};
  client_test::NeverReadService service;
  StreamMode();
  config_.concurrency = 2;
  config_.warmup_s = 0;
  config_.duration_s = 0.5;
  config_.timeout_ms = 300;
  Start(&service, shape, /*small_windows=*/true);
  Clock::duration took;
  RunResult r = RunWithin(std::chrono::seconds(20), &took);
  EXPECT_LT(took, std::chrono::seconds(5));
  EXPECT_TRUE(r.stats.calls.empty());
  ASSERT_GT(r.stats.errors["DEADLINE_EXCEEDED"], 0) << "errors: " << r.stats.errors.size();
  EXPECT_NE(r.stats.error_examples["DEADLINE_EXCEEDED"].find("stream cancelled"), std::string::npos)
      << r.stats.error_examples["DEADLINE_EXCEEDED"];
}

// A stream call that returned its answer but ran past --timeout_ms + slack before the
// worker took it back (held here in the test seam) has its stream cancelled by the
// runner: the answer counts, and the cancelled stream is replaced before the next
// call, which would fail on it.
TEST_P(StreamRunnerTest, StreamCancelledAfterItsCallSucceededIsReplacedWithoutAnError) {
  const client::Shape shape{8, 2, 16};
  CountingEchoService service(Info(shape));
  StreamMode();
  config_.concurrency = 1;
  config_.warmup_s = 0;
  config_.duration_s = 0.8;
  config_.timeout_ms = 50;  // the runner cancels calls older than 150 ms
  Start(&service, shape);
  std::atomic<bool> first{true};
  Clock::duration took;
  RunResult r = RunWithin(std::chrono::seconds(20), &took, [&first] {
    // The runner checks every 20 ms: it cancels the stream during this wait.
    if (first.exchange(false)) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  });
  EXPECT_TRUE(r.stats.errors.empty())
      << r.stats.errors.begin()->first << ": " << r.stats.error_examples.begin()->second;
  EXPECT_GT(r.stats.calls.size(), 1u);
  EXPECT_GE(service.streams_.load(), 2) << "the first stream was not cancelled and replaced";
}

// Stream workers have no thread: an open loop's arrival finds an idle worker and the
// scheduler issues its call. Every arrival is sent and answered.
TEST_P(StreamRunnerTest, OpenLoopStreamsSendEveryArrival) {
  const client::Shape shape{8, 2, 16};
  CountingEchoService service(Info(shape));
  StreamMode();
  config_.concurrency = 4;
  config_.rate = 400;
  config_.requests = 120;
  config_.warmup_s = 0;
  config_.duration_s = 0;
  Start(&service, shape);
  Clock::duration took;
  RunResult r = RunWithin(std::chrono::seconds(20), &took);
  EXPECT_TRUE(r.stats.errors.empty()) << r.stats.errors.begin()->first;
  EXPECT_EQ(r.stats.calls.size(), 120u);
  EXPECT_EQ(r.not_sent, 0);
  EXPECT_LE(service.streams_.load(), 4);
  // Sent when due, not when the generation ended (120 arrivals at 400/s: ~300 ms).
  int64_t worst_us = 0;
  for (const Sample& c : r.stats.calls) worst_us = std::max(worst_us, c.latency_us);
  EXPECT_LT(worst_us, 150000);
}

TEST_P(StreamRunnerTest, ClosedLoopStreamsStopAtTheRequestBound) {
  const client::Shape shape{8, 2, 16};
  CountingEchoService service(Info(shape));
  StreamMode();
  config_.concurrency = 3;
  config_.requests = 7;
  config_.warmup_s = 0;
  config_.duration_s = 0;
  Start(&service, shape);
  Clock::duration took;
  RunResult r = RunWithin(std::chrono::seconds(20), &took);
  EXPECT_TRUE(r.stats.errors.empty()) << r.stats.errors.begin()->first;
  EXPECT_EQ(r.stats.calls.size(), 7u);
}

// A server without DecodeStream fails every stream at once: each worker backs off
// (2, 4, ... 128 ms) instead of spinning, and the errors are counted.
TEST_P(StreamRunnerTest, FailingStreamsBackOff) {
  const client::Shape shape{8, 2, 16};
  FlakyService service(Info(shape), std::chrono::milliseconds(0));  // no DecodeStream
  StreamMode();
  config_.concurrency = 2;
  config_.warmup_s = 0;
  config_.duration_s = 0.6;
  Start(&service, shape);
  Clock::duration took;
  RunResult r = RunWithin(std::chrono::seconds(20), &took);
  EXPECT_LT(took, std::chrono::seconds(5));
  EXPECT_TRUE(r.stats.calls.empty());
  const int64_t errors = r.stats.errors["UNIMPLEMENTED"];
  EXPECT_GE(errors, 2 * 4);   // 2+4+8+16+32+64+128 ms: 7 failures per worker in 254 ms
  EXPECT_LE(errors, 2 * 14);  // without the back-off, thousands
}

TEST_F(RunnerTest, WarmUpErrorsAreNotCounted) {
  const client::Shape shape{8, 2, 16};
  FlakyService service(Info(shape), std::chrono::milliseconds(200));
  config_.mode = Mode::kUnary;
  config_.mode_name = "unary";
  config_.concurrency = 2;
  config_.warmup_s = 0.6;
  config_.duration_s = 0.3;
  Start(&service, shape);
  Clock::duration took;
  RunResult r = RunWithin(std::chrono::seconds(20), &took);
  ASSERT_GT(service.failed_.load(), 0);
  EXPECT_EQ(r.stats.warmup_errors, service.failed_.load());
  EXPECT_TRUE(r.stats.errors.empty()) << r.stats.errors.begin()->first;
  EXPECT_GT(r.stats.calls.size(), 0u);
}

TEST_F(RunnerTest, FailedBatchRpcCountsEachOfItsRequests) {
  const client::Shape shape{8, 2, 16};
  FlakyService service(Info(shape), std::chrono::milliseconds(0));
  config_.mode = Mode::kBatch;
  config_.mode_name = "batch";
  config_.concurrency = 1;
  config_.batch_size = 4;
  config_.warmup_s = 0;
  config_.duration_s = 0;
  config_.requests = 5;
  Start(&service, shape);
  Clock::duration took;
  RunResult r = RunWithin(std::chrono::seconds(20), &took);
  EXPECT_EQ(service.batch_calls_.load(), 5);
  EXPECT_EQ(r.stats.errors["UNAVAILABLE"], 5 * 4);
  EXPECT_TRUE(r.stats.calls.empty());
}

}  // namespace
}  // namespace sds::loadgen
