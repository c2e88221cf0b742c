// B5: each malformed string of a typed request made protobuf write one log line; the
// throttle lets a burst through, then one a second, and reports what it dropped.
#include "server/log_throttle.h"

#include "gtest/gtest.h"

namespace sds::server {
namespace {

TEST(LogThrottle, BurstThenOneLinePerSecondWithTheDroppedCount) {
  LogThrottle throttle(10, 1.0);
  const LogThrottle::Clock::time_point t0 = LogThrottle::Clock::now();
  int64_t suppressed = -1;
  int allowed = 0;
  for (int i = 0; i < 100000; ++i) allowed += throttle.Allow(t0, &suppressed) ? 1 : 0;
  EXPECT_EQ(allowed, 10);
  EXPECT_EQ(suppressed, 0);  // the tenth line had dropped nothing before it
  // Half a second later: still nothing.
  EXPECT_FALSE(throttle.Allow(t0 + std::chrono::milliseconds(500), &suppressed));
  // A second after the burst one line goes out and counts every refused one.
  ASSERT_TRUE(throttle.Allow(t0 + std::chrono::milliseconds(1000), &suppressed));
  EXPECT_EQ(suppressed, 100000 - 10 + 1);
  EXPECT_FALSE(throttle.Allow(t0 + std::chrono::milliseconds(1001), &suppressed));
  // A long quiet spell refills the burst, no more.
  int later = 0;
  for (int i = 0; i < 50; ++i) later += throttle.Allow(t0 + std::chrono::hours(1), &suppressed);
  EXPECT_EQ(later, 10);
}

}  // namespace
}  // namespace sds::server
