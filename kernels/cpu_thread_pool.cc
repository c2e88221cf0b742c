#include "kernels/cpu_thread_pool.h"

#include <chrono>

#include "kernels/cpu_relax.h"
#include "kernels/usable_cpus.h"

#if defined(__linux__)
#include <pthread.h>
#endif

namespace sds {
namespace {

// How long ParallelFor's caller polls for the workers' last items before it sleeps.
constexpr std::chrono::microseconds kFinishPoll{200};

}  // namespace

CpuThreadPool::CpuThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = UsableCpus();
  workers_.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this] {
#if defined(__linux__)
      pthread_setname_np(pthread_self(), "sds-cpu-pool");  // for top -H, perf, gdb
#endif
      WorkerLoop();
    });
  }
}

CpuThreadPool::~CpuThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

bool CpuThreadPool::RunItems(uint32_t generation, int64_t num_items,
                             const std::function<void(int64_t)>* fn) {
  const uint64_t tag = static_cast<uint64_t>(generation) << 32;
  uint64_t claim = claim_.load(std::memory_order_acquire);
  bool last = false;
  while ((claim >> 32) == generation && static_cast<int64_t>(claim & 0xFFFFFFFFu) < num_items) {
    if (!claim_.compare_exchange_weak(claim, claim + 1, std::memory_order_acq_rel)) continue;
    (*fn)(static_cast<int64_t>(claim - tag));
    last = done_items_.fetch_add(1, std::memory_order_acq_rel) + 1 == num_items;
    claim = claim_.load(std::memory_order_acquire);
  }
  return last;
}

void CpuThreadPool::ParallelFor(int64_t num_items, const std::function<void(int64_t)>& fn) {
  if (num_items <= 0) return;
  // Claims carry the item index in 32 bits: larger jobs run on the calling thread.
  if (workers_.empty() || num_items == 1 || num_items >= (int64_t{1} << 32)) {
    for (int64_t item = 0; item < num_items; ++item) fn(item);
    return;
  }
  uint32_t generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (++generation_ == 0) ++generation_;  // 0 is the workers' "seen nothing yet"
    generation = generation_;
    job_ = &fn;
    job_items_ = num_items;
    poll_until_ = {};  // this job answers the last Prewake: after it the workers sleep
    done_items_.store(0, std::memory_order_relaxed);
    claim_.store(static_cast<uint64_t>(generation) << 32, std::memory_order_release);
  }
  work_ready_.notify_all();
  if (RunItems(generation, num_items, &fn)) return;
  // Workers are finishing the last items, one each at most. Poll for them first: a
  // condition-variable wake-up took 30-50 us (p50) on the 2-core VM, several items' worth.
  const auto until = std::chrono::steady_clock::now() + kFinishPoll;
  while (std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 64; ++i) {
      if (done_items_.load(std::memory_order_acquire) == num_items) return;
      CpuRelax();
    }
    std::this_thread::yield();  // a worker descheduled on this core gets it back
  }
  // Still running: the worker that completes the last item notifies under the lock.
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [&] { return done_items_.load(std::memory_order_acquire) == num_items; });
}

void CpuThreadPool::Prewake(int64_t spin_us) {
  if (workers_.empty() || spin_us <= 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (until <= poll_until_) return;  // the workers poll long enough already
    poll_until_ = until;
  }
  work_ready_.notify_all();
}

void CpuThreadPool::WorkerLoop() {
  uint32_t seen_generation = 0;
  while (true) {
    uint32_t generation;
    const std::function<void(int64_t)>* job;
    int64_t items;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] {
        return stopping_ || generation_ != seen_generation ||
               std::chrono::steady_clock::now() < poll_until_;
      });
      if (stopping_) return;
      if (generation_ == seen_generation) {
        // Prewaked, no job yet: poll the claim counter (its high half is the newest job's
        // generation) until a job comes or the deadline passes, then wait again (which
        // returns at once when a job came, and polls on if Prewake moved the deadline).
        const auto deadline = poll_until_;
        lock.unlock();
        while ((claim_.load(std::memory_order_acquire) >> 32) == seen_generation &&
               !stopping_.load(std::memory_order_relaxed) &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::yield();
        }
        continue;
      }
      seen_generation = generation = generation_;
      job = job_;
      items = job_items_;
    }
    // `job` stays valid while an item of this generation is claimed and not done: the
    // caller returns only after every item is done, and a stale claim fails.
    if (RunItems(generation, items, job)) {
      { std::lock_guard<std::mutex> lock(mutex_); }  // the caller is waiting or will see it
      work_done_.notify_one();
    }
  }
}

}  // namespace sds
