// What the workers measured, and the summary computed from it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sds::loadgen {

struct Sample {
  int64_t start_us;    // intended send time, from the start of the measured window
  int64_t latency_us;  // completion - intended send time
};

// One worker's records (no locks: merged after the workers end).
struct WorkerStats {
  std::vector<Sample> calls;                  // successful calls in the measured window
  std::vector<int64_t> queue_us, compute_us;  // per successful request (server BatchInfo)
  int64_t token_layers = 0;                   // successful requests in the window
  // Failed requests (token-layers) in the window, by status code name: a DecodeBatch RPC
  // that failed as a whole counts each of its requests, like per-request errors do.
  std::map<std::string, int64_t> errors;
  std::map<std::string, std::string> error_examples;
  int64_t warmup_calls = 0;
  int64_t warmup_errors = 0;  // failed requests sent during the warm-up (not in `errors`)

  void AddError(const std::string& code, const std::string& message, int64_t requests = 1);
  void Merge(WorkerStats&& other);
};

struct Percentiles {
  int64_t count = 0;
  double mean = 0;
  int64_t p50 = 0, p90 = 0, p99 = 0, p999 = 0, max = 0;
};

// Sorts `values` in place.
Percentiles Summarize(std::vector<int64_t>& values);

}  // namespace sds::loadgen
