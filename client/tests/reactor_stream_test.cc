// ReactorStream (the load generator's stream) against in-process fake servers: an
// answer per call (also a call issued from the previous one's callback), a stream whose
// answers do not match its requests, a cancel from another thread ending a call the
// server never answers, and releasing streams with calls in flight.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "bench/e2e/echo_service.h"
#include "client/decode_client.h"
#include "client/loadgen/reactor_stream.h"
#include "client/tests/stream_test_service.h"

namespace sds::loadgen {
namespace {

class ReactorStreamTest : public StreamTestBase {
 protected:
  void TearDown() override {
    // Every stream of the test released and ended before the channel and the server go.
    EXPECT_TRUE(
        group_.WaitUntilNoneLive(std::chrono::steady_clock::now() + std::chrono::seconds(10)));
    StreamTestBase::TearDown();
  }

  // Sends `in` and returns the future of its result (the callback sets it).
  static std::future<absl::StatusOr<client::DecodeOutput>> Send(ReactorStream* s,
                                                                const client::DecodeInput& in) {
    auto promise = std::make_shared<std::promise<absl::StatusOr<client::DecodeOutput>>>();
    auto future = promise->get_future();
    s->Call(in, [promise](absl::StatusOr<client::DecodeOutput> r) {
      promise->set_value(std::move(r));
    });
    return future;
  }
  static absl::StatusOr<client::DecodeOutput> CallAndWait(ReactorStream* s,
                                                          const client::DecodeInput& in) {
    auto f = Send(s, in);
    if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready)
      return absl::DeadlineExceededError("no answer within 10 s");
    return f.get();
  }

  ReactorStream::Group group_;  // the test's streams; TearDown waits for them to end
};

TEST_F(ReactorStreamTest, EachCallGetsItsOwnAnswer) {
  Start(/*id_offset=*/0);
  auto stream = ReactorStream::Open(client_.get(), &group_);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (uint64_t id : {0, 0, 7, 0}) {  // 0: the stream numbers the request
    auto out = CallAndWait(stream->get(), Input(id));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->out.size(), size_t{kShape.num_q_heads} * kShape.head_dim);
  }
  EXPECT_TRUE((*stream)->status().ok());
}

// The load generator issues a stream's next call from the callback of its last one, on
// gRPC's thread.
constexpr int kChainCalls = 50;

TEST_F(ReactorStreamTest, CallsIssuedFromTheCallbackChain) {
  Start(/*id_offset=*/0);
  auto stream = ReactorStream::Open(client_.get(), &group_);
  ASSERT_TRUE(stream.ok()) << stream.status();
  // Each callback holds the chain, so it outlives the calls even if the test gives up.
  struct Chain : std::enable_shared_from_this<Chain> {
    ReactorStream* stream = nullptr;
    client::DecodeInput in;
    std::atomic<int> answered{0};
    std::promise<absl::Status> finished;

    void Issue() {
      stream->Call(in, [self = shared_from_this()](const absl::StatusOr<client::DecodeOutput>& r) {
        self->Answered(r);
      });
    }
    void Answered(const absl::StatusOr<client::DecodeOutput>& r) {
      if (!r.ok()) return finished.set_value(r.status());
      if (++answered == kChainCalls) return finished.set_value(absl::OkStatus());
      Issue();
    }
  };
  auto chain = std::make_shared<Chain>();
  chain->stream = stream->get();
  chain->in = Input(0);
  auto f = chain->finished.get_future();
  chain->Issue();
  const bool ready = f.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  if (!ready) {
    (*stream)->Cancel();  // ends the chain with an error
    f.wait();
  }
  ASSERT_TRUE(ready) << "the chain of calls did not finish within 10 s";
  EXPECT_TRUE(f.get().ok());
  EXPECT_EQ(chain->answered.load(), kChainCalls);
}

TEST_F(ReactorStreamTest, AnAnswerToAnotherRequestBreaksTheStream) {
  Start(/*id_offset=*/1);
  auto stream = ReactorStream::Open(client_.get(), &group_);
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto out = CallAndWait(stream->get(), Input(5));
  ASSERT_EQ(out.status().code(), absl::StatusCode::kInternal) << out.status();
  EXPECT_NE(out.status().message().find("answered request 6 while 5 was in flight"),
            std::string::npos)
      << out.status();
  EXPECT_EQ((*stream)->status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(CallAndWait(stream->get(), Input(9)).status().code(), absl::StatusCode::kInternal);
}

TEST_F(ReactorStreamTest, CancelEndsACallThatIsNeverAnswered) {
  Start(/*id_offset=*/0, /*silent=*/true);
  auto stream = ReactorStream::Open(client_.get(), &group_);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ReactorStream* s = stream->get();
  auto call = Send(s, Input(1));
  ASSERT_EQ(call.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "answered by a server that never answers";
  s->Cancel();
  ASSERT_EQ(call.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(call.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s->status().code(), absl::StatusCode::kCancelled);
  // A later call fails at once with the stream's end.
  EXPECT_EQ(CallAndWait(s, Input(2)).status().code(), absl::StatusCode::kCancelled);
}

// Dropping the handle while a call is in flight ends the stream: the call's callback
// still runs once (CANCELLED), and the stream ends (TearDown waits for it).
TEST_F(ReactorStreamTest, ReleasingAStreamWithACallInFlightAnswersTheCall) {
  Start(/*id_offset=*/0, /*silent=*/true);
  auto stream = ReactorStream::Open(client_.get(), &group_);
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto call = Send(stream->get(), Input(1));
  stream->reset();
  ASSERT_EQ(call.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(call.get().status().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace sds::loadgen
