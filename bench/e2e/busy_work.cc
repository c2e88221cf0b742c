#include "bench/e2e/busy_work.h"

#include <algorithm>
#include <chrono>

namespace sds::bench {
namespace {

// A chain of dependent multiply-adds (an LCG step each, no memory traffic): `steps` of
// them take the same time on every call. The asm barrier keeps the compiler from
// folding the loop into a closed form.
uint64_t Spin(int64_t steps) {
  uint64_t x = 0x9E3779B97F4A7C15ULL;
  for (int64_t i = 0; i < steps; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    asm volatile("" : "+r"(x));
  }
  return x;
}

}  // namespace

BusyWork::BusyWork(double us) {
  if (us <= 0) return;
  // The fastest of five probes (a few ms each): a probe that was preempted runs slow
  // and would make every later Run too short.
  constexpr int64_t kProbeSteps = 1 << 20;
  double best_ns_per_step = 1e9;
  for (int probe = 0; probe < 5; ++probe) {
    const auto start = std::chrono::steady_clock::now();
    Spin(kProbeSteps);
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    best_ns_per_step = std::min(best_ns_per_step, took.count() / kProbeSteps);
  }
  steps_ = std::max<int64_t>(1, static_cast<int64_t>(us * 1000.0 / best_ns_per_step));
}

void BusyWork::Run() const {
  if (steps_ > 0) Spin(steps_);
}

}  // namespace sds::bench
