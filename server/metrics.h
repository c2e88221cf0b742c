// Prometheus metrics of the server, rendered in the text exposition format 0.0.4.
//
// The exposition is written by hand: Debian bookworm has no prometheus-cpp package
// (`apt-cache policy libprometheus-cpp-dev` finds nothing), and the format is small.
//
// Counting rules: sds_requests_total counts every RPC once by its final status, except
// DecodeBatch and DecodeStream, which count each decode request inside them by its
// own error_code (so decode traffic is comparable across the three RPCs).
// sds_request_latency_seconds observes once per call (per message on DecodeStream), so
// for DecodeBatch its _count is calls while sds_requests_total counts items.
// sds_tokens_appended_total counts K/V rows: one per token per layer.
// Cache capacity is its own gauge (sds_cache_pages_capacity) beside
// sds_cache_pages{state="used"|"free"}, so summing sds_cache_pages counts the pool once.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace sds::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double value);
  // Appends the _bucket, _sum and _count lines; `labels` is "" or `key="value",...`.
  void Render(absl::string_view name, absl::string_view labels, std::string* out) const;

 private:
  const std::vector<double> bounds_;
  // std::mutex, not absl::Mutex: these locks are taken per request, and the packaged
  // abseil's debug deadlock detection made each absl::Mutex lock cost a graph lookup.
  mutable std::mutex mu_;         // guards the three below
  std::vector<uint64_t> counts_;  // per bucket, not cumulative
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct BuildInfo {
  std::string backend;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  std::string scale_mode;
  bool scales_default = false;
  std::string version;
};

// Values read at scrape time.
struct GaugeValues {
  int64_t queue_depth = 0;
  int64_t pages_total = 0;  // sds_cache_pages_capacity
  int64_t pages_used = 0;
  int64_t pages_free = 0;
  int64_t sequences = 0;
  int64_t active_streams = 0;
  // Registered shared-memory regions (all tenants), by kind; never their names.
  int64_t system_regions = 0;
  uint64_t system_region_bytes = 0;
  int64_t cuda_regions = 0;
  uint64_t cuda_region_bytes = 0;
};

class Metrics {
 public:
  explicit Metrics(BuildInfo info);

  void ObserveBatch(int32_t batch_size, double queue_s, double compute_s, double total_s);
  void CountRequest(absl::string_view rpc, absl::StatusCode code);
  // `count` requests of `rpc` that ended with `code` (a call's items, counted at once).
  void CountRequests(absl::string_view rpc, absl::StatusCode code, uint64_t count);
  void ObserveLatency(absl::string_view rpc, double seconds);
  // DecodeStream: from a request's batch finishing to gRPC taking its answer for sending.
  void ObserveStreamAnswerSend(double seconds);
  void AddTokensAppended(int64_t tokens);
  void SetGaugeSource(std::function<GaugeValues()> source);

  std::string Render() const;

 private:
  const BuildInfo info_;
  Histogram batch_size_;
  Histogram batch_queue_;
  Histogram batch_compute_;
  Histogram batch_total_;
  Histogram stream_answer_send_;
  // Status codes 0..16 (OK .. UNAUTHENTICATED); others are counted as UNKNOWN.
  static constexpr int kNumCodes = 17;
  mutable std::mutex mu_;  // guards everything below
  uint64_t batches_ = 0;
  uint64_t tokens_appended_ = 0;
  // Looked up by string_view (std::less<>): counting a request allocates nothing.
  std::map<std::string, std::array<uint64_t, kNumCodes>, std::less<>> requests_;  // by RPC, code
  std::map<std::string, std::unique_ptr<Histogram>, std::less<>> latency_;
  std::function<GaugeValues()> gauges_;
};

// "OK", "INVALID_ARGUMENT", ... (the gRPC spelling).
std::string StatusCodeName(absl::StatusCode code);

}  // namespace sds::server
