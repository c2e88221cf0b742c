#include "client/loadgen/runner.h"

#include <random>
#include <thread>

#include "absl/strings/str_cat.h"

namespace sds::loadgen {

struct Runner::Worker {
  int index = 0;
  client::DecodeClient* client = nullptr;
  std::vector<int> seqs;
  std::vector<Cursor> cursors;
  std::vector<client::DecodeInput> inputs;
  std::unique_ptr<client::DecodeStream> stream;
  std::mt19937_64 rng;
  WorkerStats stats;
  int consecutive_errors = 0;
  Clock::time_point call_end;
};

Runner::Runner(const Config& config,
               const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
               const Workload& workload)
    : config_(config), clients_(clients), workload_(workload) {}

RunResult Runner::Run() {
  const auto secs = [](double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  t0_ = Clock::now();
  measure_start_ = t0_ + secs(config_.warmup_s);
  end_ =
      config_.duration_s > 0 ? measure_start_ + secs(config_.duration_s) : Clock::time_point::max();
  last_success_ns_ = t0_.time_since_epoch().count();

  std::vector<Worker> workers(config_.concurrency);
  const int per = config_.SequencesPerWorker();
  for (int i = 0; i < config_.concurrency; ++i) {
    Worker& w = workers[i];
    w.index = i;
    w.client = clients_[i % clients_.size()].get();
    w.rng.seed(config_.seed * 7919 + i);
    for (int s = 0; s < per; ++s) {
      w.seqs.push_back(i * per + s);
      w.cursors.push_back(workload_.Start());
    }
    w.inputs.resize(per);
  }
  active_workers_ = config_.concurrency;
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([this, &w] { WorkerLoop(&w); });
  std::thread scheduler;
  if (config_.rate > 0) scheduler = std::thread([this] { Scheduler(); });

  RunResult result;
  Clock::time_point stop_time;
  while (true) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto now = Clock::now();
    stop_time = now;
    if (now >= end_ || active_workers_.load() == 0) break;
    const auto since_success = now - Clock::time_point(Clock::duration(last_success_ns_.load()));
    if (errors_.load() > 0 && since_success > secs(config_.stall_s)) {
      result.aborted = true;
      result.abort_reason = absl::StrCat("no call succeeded for ", config_.stall_s,
                                         " s while calls were failing: the server looks down");
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (scheduler.joinable()) scheduler.join();
  for (auto& t : threads) t.join();
  for (auto& w : workers) result.stats.Merge(std::move(w.stats));
  result.not_sent = static_cast<int64_t>(tickets_.size());
  result.measured_s = std::max(
      0.0, std::chrono::duration<double>(std::min(stop_time, end_) - measure_start_).count());
  return result;
}

void Runner::Scheduler() {
  std::mt19937_64 rng(config_.seed ^ 0x5eed);
  std::exponential_distribution<double> gap(config_.rate);
  auto t = t0_;
  int64_t n = 0;
  while (!stop_.load()) {
    t += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
    if ((config_.requests > 0 && n >= config_.requests) || t >= end_) break;
    while (!stop_.load() && Clock::now() < t) {
      std::this_thread::sleep_until(std::min(t, Clock::now() + std::chrono::milliseconds(50)));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      tickets_.push_back(t);
    }
    ++n;
    cv_.notify_one();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_done_ = true;
  }
  cv_.notify_all();
}

bool Runner::NextTicket(Clock::time_point* intended) {
  if (config_.rate <= 0) {
    if (stop_.load()) return false;
    if (config_.requests > 0 && issued_.fetch_add(1) >= config_.requests) return false;
    *intended = Clock::now();
    return true;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return stop_.load() || generation_done_ || !tickets_.empty(); });
  if (stop_.load() || tickets_.empty()) return false;
  *intended = tickets_.front();
  tickets_.pop_front();
  return true;
}

void Runner::WorkerLoop(Worker* w) {
  Clock::time_point intended;
  while (NextTicket(&intended)) {
    Execute(w, intended);
    if (w->consecutive_errors > 0 && !stop_.load()) {
      // Back off a failing server a little; a dead one then costs no CPU.
      const int shift = std::min(w->consecutive_errors, 7);
      std::this_thread::sleep_for(std::chrono::milliseconds(1 << shift));
    }
  }
  w->stream.reset();
  --active_workers_;
}

void Runner::RecordSuccess(Worker* w, Clock::time_point intended, const client::BatchStats& b,
                           bool first_of_call) {
  w->consecutive_errors = 0;
  if (first_of_call) last_success_ns_ = w->call_end.time_since_epoch().count();
  if (!Measured(intended)) {
    if (first_of_call) ++w->stats.warmup_calls;
    return;
  }
  if (first_of_call) {
    using std::chrono::duration_cast;
    using std::chrono::microseconds;
    w->stats.calls.push_back({duration_cast<microseconds>(intended - measure_start_).count(),
                              duration_cast<microseconds>(w->call_end - intended).count()});
  }
  ++w->stats.token_layers;
  w->stats.queue_us.push_back(b.queue_us);
  w->stats.compute_us.push_back(b.compute_us);
}

void Runner::RecordError(Worker* w, const absl::Status& s) {
  ++w->consecutive_errors;
  ++errors_;
  w->stats.AddError(absl::StatusCodeToString(s.code()), std::string(s.message()));
}

void Runner::Execute(Worker* w, Clock::time_point intended) {
  client::CallOptions call;
  call.timeout = std::chrono::milliseconds(config_.timeout_ms);
  for (size_t i = 0; i < w->seqs.size(); ++i) {
    workload_.FillDecode(w->seqs[i], w->cursors[i], w->rng, &w->inputs[i]);
  }
  if (config_.mode == Mode::kBatch) {
    auto r = w->client->DecodeBatch(w->inputs, call);
    w->call_end = Clock::now();
    if (!r.ok()) return RecordError(w, r.status());
    bool first = true;
    for (size_t i = 0; i < r->size(); ++i) {
      if (!(*r)[i].ok()) {
        RecordError(w, (*r)[i].status());
        continue;
      }
      RecordSuccess(w, intended, (*r)[i]->batch, first);
      first = false;
      workload_.Advance(&w->cursors[i]);
    }
    return;
  }
  absl::StatusOr<client::DecodeOutput> r;
  if (config_.mode == Mode::kUnary) {
    r = w->client->Decode(w->inputs[0], call);
  } else {
    if (!w->stream) {
      auto s = w->client->OpenStream();
      if (!s.ok()) {
        w->call_end = Clock::now();
        return RecordError(w, s.status());
      }
      w->stream = *std::move(s);
    }
    r = w->stream->Call(w->inputs[0], *call.timeout);
    // A broken or stuck stream is replaced; a request that failed alone is not.
    if (!r.ok() &&
        (!w->stream->status().ok() || r.status().code() == absl::StatusCode::kDeadlineExceeded)) {
      w->stream.reset();
    }
  }
  w->call_end = Clock::now();
  if (!r.ok()) return RecordError(w, r.status());
  RecordSuccess(w, intended, r->batch, true);
  workload_.Advance(&w->cursors[0]);
}

}  // namespace sds::loadgen
