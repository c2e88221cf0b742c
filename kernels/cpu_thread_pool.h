// A small persistent thread pool for the CPU kernels. ParallelFor hands out item
// indices dynamically; which thread runs an item never changes what the item
// computes, so results stay independent of scheduling.
//
// The caller runs items too and returns as soon as every item is done: it never waits
// for a worker that has not claimed an item yet. On a machine whose cores are shared
// with other processes (the server next to its clients) a woken worker may not run for
// a scheduler tick (~4 ms); waiting for it to check in made such ticks the p99 of
// every batch. Items that workers claimed and still run at the end are polled for
// (up to 200 us) before the caller sleeps: a wake-up costs more than such an item.
#pragma once

#include <chrono>

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
  // (num_threads - 1 workers are started). 0 means UsableCpus() (affinity and cgroup
  // quota, not the node's core count).
  explicit CpuThreadPool(int num_threads);
  ~CpuThreadPool();
  CpuThreadPool(const CpuThreadPool&) = delete;
  CpuThreadPool& operator=(const CpuThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // A hint that a ParallelFor is coming (a batch is on its way): wakes the sleeping
  // workers, which poll for a job (yielding their cores to any other runnable thread)
  // until the next ParallelFor that uses them starts (it consumes the hint: after it the
  // workers sleep again; a job the caller runs alone leaves the hint) or `spin_us` from now;
  // repeated calls extend that deadline. On a VM whose idle vCPUs halt, a worker woken by the job
  // itself joins it only ~135 us later (2-core VM, 500 us idle before each job), so jobs shorter
  // than that run on the caller alone; woken 150 us ahead it joins at once. Polling on after the
  // job kept one core busy yielding between a server's batches (half the server's CPU samples at
  // DecodeBatch 64 on 2 cores, taken from its clients). Any thread may call it, at any time; a job
  // is never waited for.
  void Prewake(int64_t spin_us);

  // Calls fn(item) for every item in [0, num_items) and returns when all are done.
  // Not reentrant: one ParallelFor at a time. Jobs of 2^32 items or more run on the
  // calling thread (a claim holds the item index in 32 bits).
  void ParallelFor(int64_t num_items, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  // Claims and runs items of job `generation` until none is left; true when this
  // thread completed the job's last item.
  bool RunItems(uint32_t generation, int64_t num_items, const std::function<void(int64_t)>* fn);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  // Guarded by mutex_: the current job, as workers pick it up, and until when idle
  // workers poll for the next one (Prewake; reset by each ParallelFor).
  uint32_t generation_ = 0;
  std::chrono::steady_clock::time_point poll_until_{};
  // Set under mutex_ (the wait's predicate); atomic so that a polling worker sees it.
  std::atomic<bool> stopping_{false};
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t job_items_ = 0;
  // The claim counter: generation in the high 32 bits, next item in the low 32. A
  // worker that picked up an old job fails its claim (the generation moved on), so
  // it never runs an item of a job it did not read.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_items_{0};  // of the current job
};

}  // namespace sds
