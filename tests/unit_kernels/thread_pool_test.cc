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

}  // namespace
}  // namespace sds
