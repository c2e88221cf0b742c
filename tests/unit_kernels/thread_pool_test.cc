#include <time.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_thread_pool.h"

namespace sds {
namespace {

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

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

// Prewake (workers woken ahead, polling for the job) changes who runs an item, never
// which items run: jobs after prewakes of every length, some landing while workers poll,
// some after they gave up, some with no job at all.
TEST(CpuThreadPoolTest, PrewakeKeepsEveryItemExactlyOnce) {
  std::mt19937 rng(7);
  for (int threads : {1, 2, 4}) {
    CpuThreadPool pool(threads);
    for (int job = 0; job < 300; ++job) {
      pool.Prewake(std::uniform_int_distribution<int>(0, 300)(rng));
      if (job % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(job % 200));
      if (job % 7 == 0) continue;  // a prewake no job follows
      const int64_t items = 1 + job % 9;
      std::vector<std::atomic<int>> hits(items);
      pool.ParallelFor(items, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < items; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << job;
    }
  }
}

// A worker polling after a long Prewake stops when the pool is destroyed, not when its
// poll time is over.
TEST(CpuThreadPoolTest, DestructionEndsAPrewakePoll) {
  const auto start = std::chrono::steady_clock::now();
  {
    CpuThreadPool pool(3);
    pool.Prewake(int64_t{20} * 1000 * 1000);                     // 20 s
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the workers poll now
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// A polling worker notices a job and takes part in it: each of the two items waits until
// both have started (so both threads run one), which times out with a worker that polls
// on past the job (the 20 s Prewake keeps it from sleeping, so no other wake-up brings
// it).
TEST(CpuThreadPoolTest, APollingWorkerJoinsTheJob) {
  CpuThreadPool pool(2);
  for (int round = 0; round < 20; ++round) {
    pool.Prewake(int64_t{20} * 1000 * 1000);
    std::this_thread::sleep_for(std::chrono::milliseconds(round % 2 == 0 ? 5 : 0));
    std::atomic<int> started{0};
    std::atomic<bool> both{true};
    pool.ParallelFor(2, [&](int64_t) {
      started.fetch_add(1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (started.load() < 2 && std::chrono::steady_clock::now() < deadline) {
      }
      if (started.load() < 2) both = false;
    });
    ASSERT_TRUE(both.load()) << "round " << round << ": the polling worker did not join";
  }
}

// A job answers the Prewake before it: afterwards the workers sleep again instead of
// polling on to the Prewake's deadline (which kept a core busy yielding between a
// server's batches). Measured as the process's CPU time while every thread is idle: a
// worker still polling would use most of a core for the whole 200 ms.
TEST(CpuThreadPoolTest, AJobEndsThePrewakePoll) {
  CpuThreadPool pool(2);
  for (int round = 0; round < 3; ++round) {
    pool.Prewake(int64_t{20} * 1000 * 1000);  // 20 s
    std::this_thread::sleep_for(std::chrono::milliseconds(round));
    std::atomic<int> hits{0};
    pool.ParallelFor(4, [&](int64_t) { hits.fetch_add(1); });
    ASSERT_EQ(hits.load(), 4);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the worker back in its wait
  const double before = ProcessCpuSeconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_LT(ProcessCpuSeconds() - before, 0.05) << "CPU seconds while idle: a worker polls on";
}

}  // namespace
}  // namespace sds
