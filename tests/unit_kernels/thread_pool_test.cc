#include <atomic>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_thread_pool.h"

namespace sds {
namespace {

TEST(CpuThreadPoolTest, RunsEveryItemExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    CpuThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t items : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(items);
      for (int repeat = 0; repeat < 20; ++repeat)
        pool.ParallelFor(items, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < items; ++i) ASSERT_EQ(hits[i].load(), 20) << threads << " " << i;
    }
  }
}

// Many short jobs back to back, with more threads than cores, so that workers often wake
// for a job that has already finished: a late worker must never run an item of the next
// job with the old job's function (or the old job's item again). Each job counts into its
// own row, so any mix-up shows as a 2 in one row and a 0 in another. (With the claim's
// generation check removed this test crashes at once on a 2-core machine: a late worker
// runs the finished job's function on an item index of the next job.)
TEST(CpuThreadPoolTest, BackToBackJobsNeverMixItemsOrFunctions) {
  constexpr int kJobs = 200000;
  constexpr int kMaxItems = 9;
  CpuThreadPool pool(8);
  std::vector<std::atomic<int>> hits(static_cast<size_t>(kJobs) * kMaxItems);
  for (int job = 0; job < kJobs; ++job) {
    const int64_t items = 2 + job % (kMaxItems - 1);  // 2..9
    std::atomic<int>* row = &hits[static_cast<size_t>(job) * kMaxItems];
    pool.ParallelFor(items, [row](int64_t i) { row[i].fetch_add(1); });
    for (int64_t i = 0; i < items; ++i)
      ASSERT_EQ(row[i].load(), 1) << "job " << job << " item " << i;
  }
  for (int job = 0; job < kJobs; ++job) {
    const int64_t items = 2 + job % (kMaxItems - 1);
    for (int64_t i = 0; i < kMaxItems; ++i)
      ASSERT_EQ(hits[static_cast<size_t>(job) * kMaxItems + i].load(), i < items ? 1 : 0)
          << "job " << job << " item " << i << " (counted after later jobs ran)";
  }
}

}  // namespace
}  // namespace sds
