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
#include "client/tests/stream_test_service.h"

namespace sds::loadgen {
namespace {

using SingleCallStreamTest = StreamTestBase;

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
