// The run's summary: a table on stdout, JSON, and gnuplot PNGs.
#pragma once

#include <string>

#include "client/decode_client.h"
#include "client/loadgen/config.h"
#include "client/loadgen/runner.h"

namespace sds::loadgen {

struct Summary {
  // Client latency of the calls completed in the window and of the arrivals charged for
  // never being sent (RunResult::not_sent_charged): `latency.count` is both together.
  Percentiles latency, queue, compute;
  double calls_per_s = 0, token_layers_per_s = 0;
  double tokens_per_s = 0;   // token-layers/s over the number of layers
  int64_t errors_total = 0;  // failed requests (token-layers), as RunResult::stats.errors
  // RunResult::client_cpu_cores per token-layer/s, in microseconds; < 0 when unknown.
  double client_cpu_us_per_token_layer = -1;
};

// Sorts the samples in `result` (needed by WritePlots afterwards).
Summary Summarize(RunResult& result, int32_t num_layers);
void PrintTable(const Config& config, const client::v1::ModelInfo& info, const RunResult& result,
                const Summary& s);
absl::Status WriteJson(const std::string& path, const Config& config,
                       const client::v1::ModelInfo& info, const RunResult& result,
                       const Summary& s);
// Writes <prefix>_latency_time.png and <prefix>_latency_dist.png through gnuplot; an
// error when any file (data, script or PNG) could not be written.
absl::Status WritePlots(const std::string& prefix, const Config& config, const RunResult& result);

}  // namespace sds::loadgen
