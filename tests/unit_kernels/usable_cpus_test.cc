// UsableCpus: the affinity mask and the cgroup quota bound the CPU count that "0 = all
// cores" and "auto" thread counts use; the quota parsers read cgroup v2 and v1 files.
#include "kernels/usable_cpus.h"

#include <thread>

#include "gtest/gtest.h"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace sds {
namespace {

TEST(UsableCpusTest, CgroupV2MaxGivesTheQuotaRoundedUp) {
  EXPECT_EQ(CpusFromCgroupV2Max("200000 100000"), 2);
  EXPECT_EQ(CpusFromCgroupV2Max("150000 100000"), 2);
  EXPECT_EQ(CpusFromCgroupV2Max("50000 100000"), 1);
  EXPECT_EQ(CpusFromCgroupV2Max("6400000 100000\n"), 64);
  EXPECT_EQ(CpusFromCgroupV2Max("max 100000"), std::nullopt);
  EXPECT_EQ(CpusFromCgroupV2Max(""), std::nullopt);
  EXPECT_EQ(CpusFromCgroupV2Max("garbage"), std::nullopt);
  EXPECT_EQ(CpusFromCgroupV2Max("100000 0"), std::nullopt);
}

TEST(UsableCpusTest, CgroupV1QuotaAndPeriod) {
  EXPECT_EQ(CpusFromCgroupV1("400000", "100000"), 4);
  EXPECT_EQ(CpusFromCgroupV1("250000", "100000"), 3);
  EXPECT_EQ(CpusFromCgroupV1("-1", "100000"), std::nullopt);
  EXPECT_EQ(CpusFromCgroupV1("", ""), std::nullopt);
}

TEST(UsableCpusTest, BetweenOneAndTheNodesCount) {
  const int cpus = UsableCpus();
  EXPECT_GE(cpus, 1);
  const unsigned node = std::thread::hardware_concurrency();
  if (node > 0) {
    EXPECT_LE(cpus, static_cast<int>(node));
  }
}

#if defined(__linux__)
// A process pinned to one CPU (taskset -c 0, a cpuset) may use one, whatever the node has.
TEST(UsableCpusTest, FollowsTheAffinityMask) {
  cpu_set_t saved;
  ASSERT_EQ(sched_getaffinity(0, sizeof saved, &saved), 0);
  int first = -1;
  for (int cpu = 0; cpu < CPU_SETSIZE && first < 0; ++cpu)
    if (CPU_ISSET(cpu, &saved)) first = cpu;
  ASSERT_GE(first, 0);
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  const int pinned = UsableCpus();
  ASSERT_EQ(sched_setaffinity(0, sizeof saved, &saved), 0);
  EXPECT_EQ(pinned, 1);
}
#endif

}  // namespace
}  // namespace sds
