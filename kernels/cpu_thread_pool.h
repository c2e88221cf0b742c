// A small persistent thread pool for the CPU kernels. ParallelFor hands out item
// indices dynamically; which thread runs an item never changes what the item
// computes, so results stay independent of scheduling.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sds {

class CpuThreadPool {
 public:
  // `num_threads` threads take part in each ParallelFor, the caller included
  // (num_threads - 1 workers are started). 0 means std::thread::hardware_concurrency().
  explicit CpuThreadPool(int num_threads);
  ~CpuThreadPool();
  CpuThreadPool(const CpuThreadPool&) = delete;
  CpuThreadPool& operator=(const CpuThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(item) for every item in [0, num_items) and returns when all are done.
  // Not reentrant: one ParallelFor at a time.
  void ParallelFor(int64_t num_items, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunItems();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  // Guarded by mutex_.
  uint64_t generation_ = 0;
  int busy_workers_ = 0;
  bool stopping_ = false;
  // The current job; written under mutex_ before generation_ is bumped.
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t job_items_ = 0;
  std::atomic<int64_t> next_item_{0};
};

}  // namespace sds
