#include "kernels/cpu_thread_pool.h"

namespace sds {

CpuThreadPool::CpuThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = 1;
  workers_.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

CpuThreadPool::~CpuThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void CpuThreadPool::RunItems() {
  for (int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed); item < job_items_;
       item = next_item_.fetch_add(1, std::memory_order_relaxed)) {
    (*job_)(item);
  }
}

void CpuThreadPool::ParallelFor(int64_t num_items, const std::function<void(int64_t)>& fn) {
  if (num_items <= 0) return;
  if (workers_.empty() || num_items == 1) {
    for (int64_t item = 0; item < num_items; ++item) fn(item);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_items_ = num_items;
    next_item_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_ready_.notify_all();
  RunItems();
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [this] { return busy_workers_ == 0; });
  job_ = nullptr;
}

void CpuThreadPool::WorkerLoop() {
  uint64_t seen_generation = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen_generation; });
      if (stopping_) return;
      seen_generation = generation_;
    }
    RunItems();
    bool last;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last = --busy_workers_ == 0;
    }
    if (last) work_done_.notify_one();
  }
}

}  // namespace sds
