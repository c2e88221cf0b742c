#include "client/loadgen/stats.h"

#include <algorithm>
#include <cmath>
#include <iterator>

namespace sds::loadgen {

void WorkerStats::AddError(const std::string& code, const std::string& message, int64_t requests) {
  errors[code] += requests;
  error_examples.try_emplace(code, message);
}

void WorkerStats::Merge(WorkerStats&& o) {
  calls.insert(calls.end(), o.calls.begin(), o.calls.end());
  queue_us.insert(queue_us.end(), o.queue_us.begin(), o.queue_us.end());
  compute_us.insert(compute_us.end(), o.compute_us.begin(), o.compute_us.end());
  token_layers += o.token_layers;
  warmup_calls += o.warmup_calls;
  warmup_errors += o.warmup_errors;
  for (auto& [k, v] : o.errors) errors[k] += v;
  for (auto& [k, v] : o.error_examples) error_examples.try_emplace(k, v);
}

Percentiles Summarize(std::vector<int64_t>& v) {
  Percentiles p;
  p.count = static_cast<int64_t>(v.size());
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (int64_t x : v) sum += static_cast<double>(x);
  p.mean = sum / static_cast<double>(v.size());
  // Nearest-rank percentile.
  auto at = [&](double q) {
    size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
    return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
  };
  p.p50 = at(0.50);
  p.p90 = at(0.90);
  p.p99 = at(0.99);
  p.p999 = at(0.999);
  p.max = v.back();
  return p;
}

}  // namespace sds::loadgen
