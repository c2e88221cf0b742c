// Runs independent setup and teardown calls (prefill, release) a few at a time.
#pragma once

#include <functional>

#include "absl/status/status.h"

namespace sds::loadgen {

// Runs fn(i) for i in [0, n) on up to `threads` threads; returns the first error, after
// which no further i is started (those running finish). With `stop_on_error` false every
// i runs (a teardown wants every sequence tried).
absl::Status ParallelFor(int n, int threads, const std::function<absl::Status(int)>& fn,
                         bool stop_on_error = true);

}  // namespace sds::loadgen
