#include "server/metrics.h"

#include <charconv>
#include <cmath>
#include <memory>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace sds::server {
namespace {

// Batch phases (queue wait, compute, executor time): 5 us .. 1 s. A GPU batch's queue
// wait and compute are 15-35 us, so the low end must resolve single microseconds
// (histogram_quantile interpolates inside a bucket and cannot see below its width).
std::vector<double> BatchSecondsBuckets() {
  return {5e-6, 10e-6, 20e-6, 30e-6, 50e-6, 75e-6, 100e-6, 150e-6, 200e-6, 300e-6, 500e-6,
          1e-3, 2e-3,  5e-3,  10e-3, 20e-3, 50e-3, 100e-3, 200e-3, 500e-3, 1};
}

// Server-side RPC latency: the batch range plus a tail to 10 s (a DecodeBatch of
// hundreds of items, AppendKV of a long prefill, a backlog).
std::vector<double> RequestSecondsBuckets() {
  std::vector<double> bounds = BatchSecondsBuckets();
  bounds.insert(bounds.end(), {2, 5, 10});
  return bounds;
}

std::vector<double> BatchSizeBuckets() { return {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}; }

// Shortest text that reads back as the same double.
std::string Number(double value) {
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

void Header(std::string* out, absl::string_view name, absl::string_view type,
            absl::string_view help) {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

// Label values here are program constants and status names; escape anyway.
std::string Escape(absl::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace

std::string StatusCodeName(absl::StatusCode code) {
  return absl::AsciiStrToUpper(absl::StatusCodeToString(code));
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  size_t bucket = 0;
  while (bucket < bounds_.size() && value > bounds_[bucket]) ++bucket;
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::Render(absl::string_view name, absl::string_view labels, std::string* out) const {
  std::vector<uint64_t> counts;
  double sum;
  uint64_t count;
  {
    std::lock_guard<std::mutex> lock(mu_);
    counts = counts_;
    sum = sum_;
    count = count_;
  }
  const std::string sep = labels.empty() ? "" : ",";
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts[i];
    const double le = i < bounds_.size() ? bounds_[i] : INFINITY;
    absl::StrAppend(out, name, "_bucket{", labels, sep, "le=\"", Number(le), "\"} ", cumulative,
                    "\n");
  }
  const std::string braces = labels.empty() ? "" : absl::StrCat("{", labels, "}");
  absl::StrAppend(out, name, "_sum", braces, " ", Number(sum), "\n");
  absl::StrAppend(out, name, "_count", braces, " ", count, "\n");
}

Metrics::Metrics(BuildInfo info)
    : info_(std::move(info)),
      batch_size_(BatchSizeBuckets()),
      batch_queue_(BatchSecondsBuckets()),
      batch_compute_(BatchSecondsBuckets()),
      batch_total_(BatchSecondsBuckets()),
      stream_answer_send_(RequestSecondsBuckets()) {}

void Metrics::ObserveBatch(int32_t batch_size, double queue_s, double compute_s, double total_s) {
  batch_size_.Observe(batch_size);
  batch_queue_.Observe(queue_s);
  batch_compute_.Observe(compute_s);
  batch_total_.Observe(total_s);
  std::lock_guard<std::mutex> lock(mu_);
  ++batches_;
}

void Metrics::CountRequest(absl::string_view rpc, absl::StatusCode code) {
  CountRequests(rpc, code, 1);
}

void Metrics::CountRequests(absl::string_view rpc, absl::StatusCode code, uint64_t count) {
  int index = static_cast<int>(code);
  if (index < 0 || index >= kNumCodes) index = static_cast<int>(absl::StatusCode::kUnknown);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(rpc);
  if (it == requests_.end())
    it = requests_.emplace(std::string(rpc), std::array<uint64_t, kNumCodes>{}).first;
  it->second[index] += count;
}

void Metrics::ObserveLatency(absl::string_view rpc, double seconds) {
  Histogram* histogram;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = latency_.find(rpc);
    if (it == latency_.end()) {
      it = latency_.emplace(std::string(rpc), std::make_unique<Histogram>(RequestSecondsBuckets()))
               .first;
    }
    histogram = it->second.get();  // never removed, so the pointer stays valid
  }
  histogram->Observe(seconds);
}

void Metrics::ObserveStreamAnswerSend(double seconds) { stream_answer_send_.Observe(seconds); }

void Metrics::AddTokensAppended(int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  tokens_appended_ += tokens;
}

void Metrics::SetGaugeSource(std::function<GaugeValues()> source) {
  std::lock_guard<std::mutex> lock(mu_);
  gauges_ = std::move(source);
}

std::string Metrics::Render() const {
  std::string out;
  std::function<GaugeValues()> source;
  uint64_t batches, tokens;
  std::map<std::pair<std::string, std::string>, uint64_t> requests;  // (rpc, code name)
  std::vector<std::pair<std::string, const Histogram*>> latency;
  {
    std::lock_guard<std::mutex> lock(mu_);
    source = gauges_;
    batches = batches_;
    tokens = tokens_appended_;
    for (const auto& [rpc, counts] : requests_) {
      for (int code = 0; code < kNumCodes; ++code) {
        if (counts[code] > 0) {
          requests[{rpc, StatusCodeName(static_cast<absl::StatusCode>(code))}] = counts[code];
        }
      }
    }
    for (const auto& [rpc, histogram] : latency_) latency.emplace_back(rpc, histogram.get());
  }
  const GaugeValues gauges = source ? source() : GaugeValues{};

  Header(&out, "sds_build_info", "gauge", "Build and model configuration of this server.");
  absl::StrAppend(&out, "sds_build_info{backend=\"", Escape(info_.backend), "\",num_q_heads=\"",
                  info_.num_q_heads, "\",num_kv_heads=\"", info_.num_kv_heads, "\",head_dim=\"",
                  info_.head_dim, "\",scale_mode=\"", Escape(info_.scale_mode),
                  "\",scales_default=\"", info_.scales_default ? "true" : "false", "\",version=\"",
                  Escape(info_.version), "\"} 1\n");

  Header(&out, "sds_batch_size", "histogram", "Decode requests per launched batch.");
  batch_size_.Render("sds_batch_size", "", &out);
  Header(&out, "sds_batch_queue_seconds", "histogram",
         "Time the oldest request of a batch waited in the queue.");
  batch_queue_.Render("sds_batch_queue_seconds", "", &out);
  Header(&out, "sds_batch_compute_seconds", "histogram",
         "Backend compute time per batch (device time on cuda, wall time on cpu).");
  batch_compute_.Render("sds_batch_compute_seconds", "", &out);
  Header(&out, "sds_batch_total_seconds", "histogram",
         "Executor time per batch: cache preparation, compute and responses (queue wait "
         "excluded: see sds_batch_queue_seconds).");
  batch_total_.Render("sds_batch_total_seconds", "", &out);

  Header(&out, "sds_request_latency_seconds", "histogram",
         "Server-side latency per RPC call, queue wait included (per message on DecodeStream; "
         "one observation per DecodeBatch call, whatever its number of items).");
  for (const auto& [rpc, histogram] : latency) {
    histogram->Render("sds_request_latency_seconds", absl::StrCat("rpc=\"", Escape(rpc), "\""),
                      &out);
  }

  Header(&out, "sds_stream_answer_send_seconds", "histogram",
         "DecodeStream: time from a request's batch finishing (or its refusal) to gRPC "
         "taking its answer for sending: hand-off to an answer thread, waiting behind the "
         "stream's earlier answers, transport flow control. Overlaps "
         "sds_request_latency_seconds only by the hand-off.");
  stream_answer_send_.Render("sds_stream_answer_send_seconds", "", &out);

  Header(&out, "sds_requests_total", "counter",
         "Requests by RPC and final status code. DecodeBatch and DecodeStream count each "
         "decode item by its own error_code (so rpc=\"DecodeBatch\" counts items, while "
         "sds_request_latency_seconds_count counts DecodeBatch calls).");
  for (const auto& [key, value] : requests) {
    absl::StrAppend(&out, "sds_requests_total{rpc=\"", Escape(key.first), "\",code=\"",
                    Escape(key.second), "\"} ", value, "\n");
  }
  Header(&out, "sds_batches_total", "counter", "Decode batches launched.");
  absl::StrAppend(&out, "sds_batches_total ", batches, "\n");
  Header(&out, "sds_tokens_appended_total", "counter",
         "K/V rows written into the cache: one per token per layer (a decode item adds 1, "
         "an AppendKV of n tokens adds n).");
  absl::StrAppend(&out, "sds_tokens_appended_total ", tokens, "\n");

  Header(&out, "sds_queue_depth", "gauge", "Work items waiting in the batcher queue.");
  absl::StrAppend(&out, "sds_queue_depth ", gauges.queue_depth, "\n");
  // Capacity has its own gauge: sum(sds_cache_pages) is the pool, counted once.
  Header(&out, "sds_cache_pages_capacity", "gauge", "KV cache pages in the pool (used + free).");
  absl::StrAppend(&out, "sds_cache_pages_capacity ", gauges.pages_total, "\n");
  Header(&out, "sds_cache_pages", "gauge", "KV cache pages by state (used, free).");
  absl::StrAppend(&out, "sds_cache_pages{state=\"used\"} ", gauges.pages_used, "\n");
  absl::StrAppend(&out, "sds_cache_pages{state=\"free\"} ", gauges.pages_free, "\n");
  Header(&out, "sds_sequences", "gauge", "Live sequences in the cache (all tenants).");
  absl::StrAppend(&out, "sds_sequences ", gauges.sequences, "\n");
  Header(&out, "sds_active_streams", "gauge", "Open DecodeStream calls.");
  absl::StrAppend(&out, "sds_active_streams ", gauges.active_streams, "\n");
  Header(&out, "sds_shm_regions", "gauge", "Registered shared-memory regions, by kind.");
  absl::StrAppend(&out, "sds_shm_regions{kind=\"system\"} ", gauges.system_regions, "\n");
  absl::StrAppend(&out, "sds_shm_regions{kind=\"cuda\"} ", gauges.cuda_regions, "\n");
  Header(&out, "sds_shm_region_bytes", "gauge",
         "Bytes of the registered shared-memory regions, by kind.");
  absl::StrAppend(&out, "sds_shm_region_bytes{kind=\"system\"} ", gauges.system_region_bytes, "\n");
  absl::StrAppend(&out, "sds_shm_region_bytes{kind=\"cuda\"} ", gauges.cuda_region_bytes, "\n");
  return out;
}

}  // namespace sds::server
