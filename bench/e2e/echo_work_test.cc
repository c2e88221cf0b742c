// BusyWork and the echo's --work_us: the work is spent (thread CPU time, which a
// preemption does not inflate), scales with the microseconds asked, and is spent per
// answered request.
#include <time.h>

#include <algorithm>
#include <vector>

#include "bench/e2e/busy_work.h"
#include "bench/e2e/echo_service.h"
#include "gtest/gtest.h"

namespace sds::bench {
namespace {

double ThreadCpuUs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

// The median CPU microseconds of `runs` calls of `f` on this thread.
template <typename F>
double MedianCpuUs(int runs, F f) {
  std::vector<double> took;
  for (int i = 0; i < runs; ++i) {
    const double start = ThreadCpuUs();
    f();
    took.push_back(ThreadCpuUs() - start);
  }
  std::sort(took.begin(), took.end());
  return took[took.size() / 2];
}

TEST(BusyWorkTest, ZeroDoesNothing) {
  const BusyWork none(0);
  EXPECT_EQ(none.steps(), 0);
  EXPECT_LT(MedianCpuUs(9, [&] { none.Run(); }), 20.0);
}

TEST(BusyWorkTest, SpendsAboutTheMicrosecondsAsked) {
  const BusyWork work(300);
  const double took = MedianCpuUs(9, [&] { work.Run(); });
  // At least most of it (a core that turbos up after calibration runs the loop faster),
  // and not a unit off (ns taken for us would be 1000x).
  EXPECT_GE(took, 150.0);
  EXPECT_LE(took, 1200.0);
}

TEST(BusyWorkTest, StepsScaleWithTheMicroseconds) {
  const BusyWork small(100), large(400);
  ASSERT_GT(small.steps(), 0);
  const double ratio = static_cast<double>(large.steps()) / static_cast<double>(small.steps());
  EXPECT_GT(ratio, 2.5);
  EXPECT_LT(ratio, 6.0);
}

TEST(EchoWorkTest, EveryAnswerSpendsTheWork) {
  v1::ModelInfo info;
  info.set_num_q_heads(8);
  info.set_head_dim(64);
  const EchoService plain(info), working(info, 300);
  v1::DecodeRequest req;
  req.set_request_id(7);
  v1::DecodeResponse resp;
  const double plain_us = MedianCpuUs(9, [&] { plain.Answer(req, 1, 1, &resp); });
  const double working_us = MedianCpuUs(9, [&] { working.Answer(req, 1, 1, &resp); });
  EXPECT_GE(working_us - plain_us, 150.0);
  EXPECT_EQ(resp.request_id(), 7u);
  EXPECT_EQ(resp.out().data().size(), size_t{2} * 8 * 64);  // the answer is still the real size
}

}  // namespace
}  // namespace sds::bench
