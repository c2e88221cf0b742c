// TaskPool (server/task_pool.h): every posted task runs exactly once, the destructor
// runs what is still queued, and a throwing task does not stop the pool.
#include "server/task_pool.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace sds::server {
namespace {

TEST(TaskPool, RunsEveryTaskOnceFromManyPosters) {
  constexpr int kPosters = 4, kTasks = 2000;
  std::vector<std::atomic<int>> runs(kPosters * kTasks);
  {
    TaskPool pool(3, "test-pool");
    std::vector<std::thread> posters;
    for (int p = 0; p < kPosters; ++p) {
      posters.emplace_back([&, p] {
        for (int i = 0; i < kTasks; ++i) pool.Post([&runs, k = p * kTasks + i] { ++runs[k]; });
      });
    }
    for (std::thread& t : posters) t.join();
  }  // the destructor runs what is left
  for (size_t k = 0; k < runs.size(); ++k) ASSERT_EQ(runs[k].load(), 1) << k;
}

TEST(TaskPool, DestructorRunsQueuedTasks) {
  std::atomic<int> ran{0};
  absl::Notification release;
  std::thread releaser;
  {
    TaskPool pool(1, "test-pool");
    pool.Post([&] { release.WaitForNotification(); });  // holds the only thread
    for (int i = 0; i < 10; ++i) pool.Post([&] { ++ran; });
    releaser = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      release.Notify();
    });
  }  // waits for the first task, then runs the ten
  releaser.join();
  EXPECT_EQ(ran.load(), 10);
}

TEST(TaskPool, AThrowingTaskIsDroppedAndThePoolGoesOn) {
  std::atomic<int> ran{0};
  {
    TaskPool pool(2, "test-pool");
    pool.Post([] { throw std::runtime_error("boom"); });
    for (int i = 0; i < 100; ++i) pool.Post([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 100);
}

}  // namespace
}  // namespace sds::server
