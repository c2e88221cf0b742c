#include "client/loadgen/progress.h"

#include <cstdio>

namespace sds::loadgen {

ProgressLine::ProgressLine(double every_s, Clock::time_point t0)
    : every_(every_s > 0 ? std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(every_s))
                         : Clock::duration::zero()),
      t0_(t0),
      next_(t0 + every_),
      last_(t0) {}

void ProgressLine::Tick(Clock::time_point now, int64_t calls, int64_t token_layers,
                        int64_t errors) {
  if (every_ == Clock::duration::zero() || now < next_) return;
  const double since_last = std::chrono::duration<double>(now - last_).count();
  const double rate = since_last > 0 ? (token_layers - last_token_layers_) / since_last : 0;
  std::fprintf(stderr,
               "decode_loadgen: %.1f s: %lld calls, %.0f token-layers/s (last %.1f s), %lld "
               "errors\n",
               std::chrono::duration<double>(now - t0_).count(), (long long)calls, rate, since_last,
               (long long)errors);
  last_ = now;
  last_token_layers_ = token_layers;
  while (next_ <= now) next_ += every_;
}

}  // namespace sds::loadgen
