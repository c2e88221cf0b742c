// Spin-then-sleep for the batcher's threads (--idle_spin_us): a thread that runs out of
// work keeps polling for a while before it sleeps on its condition variable, so that
// work arriving soon after does not pay a futex wake-up (tens of microseconds on a
// loaded or virtualised host, plus a cold core) on the latency path of a lone request.
// It costs up to one core per spinning thread while the server idles.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "kernels/cpu_relax.h"

namespace sds::server {

// Polls `done()` until it holds (true) or `until` has passed (false), handing the core
// to any runnable thread between rounds. No lock is held: `done` reads atomics, and the
// caller checks its state again under its lock.
template <typename Done>
bool SpinUntil(std::chrono::steady_clock::time_point until, Done done) {
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      CpuRelax();
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    // Hands the core to any thread runnable on it (returns at once when there is none):
    // a spinner that kept its core for the whole spin made a woken gRPC or answer
    // thread queued behind it wait up to the spin's length (16 streams over 4
    // connections on the H200 host: a 2 ms queue-wait tail at --idle_spin_us=2000).
    std::this_thread::yield();
  }
}

// Waits on `cv` under `lock` until `ready()`. When `spin` is positive it first spins,
// with the lock released, until `events` changes (a counter bumped under the same mutex
// whenever the state `ready` reads changes) or `spin` has passed; then, whatever the
// change was, `ready` is checked under the lock and the thread sleeps if it is still
// false (so a change that does not make it ready ends the spin: e.g. a unit run on
// another thread, which the executor must not spin beside). The spin only saves the
// wake-up; as in any condition-variable wait, no notification is lost.
template <typename Ready>
void SpinThenWait(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                  const std::atomic<uint64_t>& events, std::chrono::microseconds spin,
                  Ready ready) {
  if (ready()) return;
  if (spin.count() > 0) {
    const uint64_t seen = events.load(std::memory_order_relaxed);  // exact: under the lock
    lock.unlock();
    // The data: under the lock, below.
    SpinUntil(std::chrono::steady_clock::now() + spin,
              [&] { return events.load(std::memory_order_relaxed) != seen; });
    lock.lock();
  }
  cv.wait(lock, ready);
}

}  // namespace sds::server
