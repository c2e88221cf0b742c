#include "client/loadgen/sweep.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace sds::loadgen {

absl::StatusOr<SweepSpec> ParseSweep(absl::string_view spec) {
  SweepSpec sweep;
  if (spec.empty()) return sweep;
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sweep=", spec, ": ", why,
                     " (use concurrency|streams|rate|batch_size:V1,V2,..., e.g. "
                     "concurrency:1,4,16)"));
  };
  const size_t colon = spec.find(':');
  if (colon == absl::string_view::npos) return bad("no ':'");
  sweep.dimension = std::string(spec.substr(0, colon));
  if (sweep.dimension == "streams") sweep.dimension = "concurrency";
  const bool integral = sweep.dimension == "concurrency" || sweep.dimension == "batch_size";
  if (!integral && sweep.dimension != "rate") return bad("unknown dimension");
  for (absl::string_view v : absl::StrSplit(spec.substr(colon + 1), ',')) {
    double x;
    if (!absl::SimpleAtod(v, &x) || !std::isfinite(x)) return bad(absl::StrCat("'", v, "'"));
    if (integral && (x < 1 || x != std::floor(x) || x > 1e6)) {
      return bad(absl::StrCat(sweep.dimension, " must be a whole number >= 1"));
    }
    if (x < 0) return bad("rate must be >= 0");
    sweep.values.push_back(x);
  }
  return sweep;
}

Config AtPoint(const Config& base, double value) {
  Config c = base;
  if (c.sweep.dimension == "concurrency") {
    c.concurrency = static_cast<int>(value);
    if (c.stream_api_auto) {
      c.stream_api = c.concurrency <= kSyncStreamsUpTo ? StreamApi::kSync : StreamApi::kCallback;
    }
  } else if (c.sweep.dimension == "rate") {
    c.rate = value;
  } else if (c.sweep.dimension == "batch_size") {
    c.batch_size = static_cast<int>(value);
  }
  return c;
}

std::string PointValue(const Config& c) {
  if (c.sweep.dimension == "rate") return absl::StrCat(c.rate);
  if (c.sweep.dimension == "batch_size") return absl::StrCat(c.batch_size);
  if (c.sweep.dimension == "concurrency") return absl::StrCat(c.concurrency);
  return "";
}

}  // namespace sds::loadgen
