// The run's summary: a table on stdout, JSON, and gnuplot PNGs.
#pragma once

#include <string>

#include "client/decode_client.h"
#include "client/loadgen/config.h"
#include "client/loadgen/runner.h"

namespace sds::loadgen {

struct Summary {
  Percentiles latency, queue, compute;
  double calls_per_s = 0, token_layers_per_s = 0;
  int64_t errors_total = 0;
};

// Sorts the samples in `result` (needed by WritePlots afterwards).
Summary Summarize(RunResult& result);
void PrintTable(const Config& config, const client::v1::ModelInfo& info, const RunResult& result,
                const Summary& s);
absl::Status WriteJson(const std::string& path, const Config& config,
                       const client::v1::ModelInfo& info, const RunResult& result,
                       const Summary& s);
// Writes <prefix>_latency_time.png and <prefix>_latency_dist.png through gnuplot.
absl::Status WritePlots(const std::string& prefix, const Config& config, const RunResult& result);

}  // namespace sds::loadgen
