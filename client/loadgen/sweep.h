// A sweep over one dimension of the load in a single invocation (as perf_analyzer's
// --concurrency-range): each point is a run of its own, prefilled and released apart.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/loadgen/config.h"

namespace sds::loadgen {

// Parses "DIMENSION:V1,V2,..." (DIMENSION: concurrency, alias streams; rate; batch_size).
// An empty `spec` is no sweep.
absl::StatusOr<SweepSpec> ParseSweep(absl::string_view spec);

// `base` with the sweep's dimension set to `value` (and what depends on it redone: the
// automatic --stream_api choice).
Config AtPoint(const Config& base, double value);

// The point's value of the swept dimension ("16"); empty without a sweep.
std::string PointValue(const Config& point);

}  // namespace sds::loadgen
