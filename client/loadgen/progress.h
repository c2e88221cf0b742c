// Progress lines on stderr during a run, so that a long one shows it is alive and how
// it goes (a failing server shows as errors long before the summary).
#pragma once

#include <chrono>
#include <cstdint>

namespace sds::loadgen {

class ProgressLine {
 public:
  using Clock = std::chrono::steady_clock;
  // Every `every_s` seconds from `t0`; `every_s` <= 0: never.
  ProgressLine(double every_s, Clock::time_point t0);
  // Prints a line when one is due: the counts are totals since t0 (warm-up included),
  // the rate is over the time since the last line.
  void Tick(Clock::time_point now, int64_t calls, int64_t token_layers, int64_t errors);

 private:
  Clock::duration every_;
  Clock::time_point t0_, next_, last_;
  int64_t last_token_layers_ = 0;
};

}  // namespace sds::loadgen
