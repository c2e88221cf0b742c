// A fixed amount of CPU work, for the echo server's --work_us: an echo that also spends
// W microseconds of CPU per request models a server whose only cost beyond gRPC's is
// W us of computing. Its rate, as a ratio to the plain echo's on the same host, is the
// best a server costing W us per request can reach there (on a host that the load
// generator shares, gRPC's own cost per message rises as the rate falls: fewer messages
// per read and per wake-up).
#pragma once

#include <cstdint>

namespace sds::bench {

class BusyWork {
 public:
  // Calibrates (a few tens of ms on this thread) how many loop steps take `us`
  // microseconds.
  // us <= 0: Run does nothing.
  explicit BusyWork(double us);

  // Spends the calibrated steps on the calling thread: the same instructions each time,
  // so a preempted run takes longer on the clock but the same CPU.
  void Run() const;

  int64_t steps() const { return steps_; }

 private:
  int64_t steps_ = 0;
};

}  // namespace sds::bench
