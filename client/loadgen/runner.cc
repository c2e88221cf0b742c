#include "client/loadgen/runner.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/loadgen/progress.h"
#include "client/loadgen/runner_worker.h"
#include "client/loadgen/stop_signal.h"

namespace sds::loadgen {

namespace {

int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

// CPU seconds this process has used so far, all threads (CLOCK_PROCESS_CPUTIME_ID).
double ProcessCpuSeconds() {
  timespec t{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t) != 0) return 0;
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace

Runner::Runner(const Config& config,
               const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
               const Workload& workload)
    : config_(config), clients_(clients), workload_(workload) {}

Runner::~Runner() {
  // gRPC ends a released stream soon (it is cancelled); its reactor must not outlive
  // streams_ (nor the clients' channels).
  for (auto& w : workers_) DropStream(w.get());
  if (!streams_.WaitUntilNoneLive(Clock::now() + std::chrono::seconds(30))) {
    std::fprintf(stderr, "decode_loadgen: DecodeStream calls still open 30 s after their cancel\n");
    std::abort();
  }
}

RunResult Runner::Run() {
  const auto secs = [](double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  t0_ = Clock::now();
  measure_start_ = t0_ + secs(config_.warmup_s);
  end_ =
      config_.duration_s > 0 ? measure_start_ + secs(config_.duration_s) : Clock::time_point::max();
  last_success_ns_ = t0_.time_since_epoch().count();

  const int per = config_.SequencesPerWorker();
  for (int i = 0; i < config_.concurrency; ++i) {
    Worker& w = *workers_.emplace_back(std::make_unique<Worker>());
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
  const bool streams = StreamsOnCallbacks();
  std::vector<std::thread> threads;
  if (!streams) {
    for (auto& w : workers_) threads.emplace_back([this, w = w.get()] { WorkerLoop(w); });
  }
  std::thread scheduler;
  if (config_.rate > 0) scheduler = std::thread([this] { Scheduler(); });
  if (streams) {
    for (auto& w : workers_) StreamNext(w.get());
  }

  RunResult result;
  Clock::time_point stop_time;   // the last check's time: when the run was decided over
  Clock::time_point cpu_from{};  // the first check in the measured window
  double cpu_from_s = 0;
  ProgressLine progress(config_.progress_s, t0_);
  while (true) {
    {
      // Every 20 ms, or at the end of the first stream worker's back-off.
      std::unique_lock<std::mutex> lock(mu_);
      auto wake = Clock::now() + std::chrono::milliseconds(20);
      for (const auto& b : backing_off_) wake = std::min(wake, b.first);
      backoff_cv_.wait_until(lock, wake);
    }
    const auto now = Clock::now();
    stop_time = now;
    if (cpu_from == Clock::time_point{} && Measured(now)) {
      cpu_from = now;
      cpu_from_s = ProcessCpuSeconds();
    }
    if (now >= end_ || active_workers_.load() == 0) break;
    if (StopRequested()) {
      result.interrupted = true;
      break;
    }
    progress.Tick(now, calls_ok_.load(), token_layers_ok_.load(), errors_.load());
    if (streams) {
      for (Worker* w : DueBackOffs(now)) StreamNext(w);
    }
    if (config_.mode == Mode::kStream) CancelStreams(/*all=*/false);
    const auto since_success = now - Clock::time_point(Clock::duration(last_success_ns_.load()));
    if (errors_.load() > 0 && since_success > secs(config_.stall_s)) {
      result.aborted = true;
      result.abort_reason = absl::StrCat("no call succeeded for ", config_.stall_s,
                                         " s while calls were failing: the server looks down");
      break;
    }
  }
  if (cpu_from != Clock::time_point{} && stop_time > cpu_from) {
    result.client_cpu_cores = (ProcessCpuSeconds() - cpu_from_s) /
                              std::chrono::duration<double>(stop_time - cpu_from).count();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_time_ = stop_time;
    stop_ = true;
  }
  cv_.notify_all();
  if (scheduler.joinable()) scheduler.join();
  StopWorkers(threads, result.aborted);
  for (auto& w : workers_) result.stats.Merge(std::move(w->stats));
  // What is still queued and was due by the stop was never sent. Later ones are not part
  // of the run: the scheduler, which does not wait for the lock, may queue arrivals due
  // between the last check (stop_time) and stop_ being set. The scheduler and the
  // workers are joined: no lock needed.
  for (const Clock::time_point t : tickets_) {
    if (t > stop_time) continue;
    ++result.not_sent;
    if (Measured(t)) {
      result.not_sent_charged.push_back({Micros(t - measure_start_), Micros(stop_time - t)});
    }
  }
  result.measured_s = std::max(
      0.0, std::chrono::duration<double>(std::min(stop_time, end_) - measure_start_).count());
  return result;
}

void Runner::StopWorkers(std::vector<std::thread>& threads, bool abort) {
  if (StreamsOnCallbacks()) FinishWaitingStreamWorkers();
  // A down server is not waited for.
  if (abort) CancelStreams(/*all=*/true);
  // Calls in flight end within --timeout_ms: unary and batch calls by their deadline,
  // stream calls by CancelStreams.
  // Past that something is stuck: cancel every stream, so that the joins return.
  const auto give_up = Clock::now() + std::chrono::milliseconds(config_.timeout_ms) +
                       kStreamCallSlack + std::chrono::seconds(1);
  while (active_workers_.load() > 0) {
    if (Clock::now() >= give_up) {
      CancelStreams(/*all=*/true);
      break;
    }
    CancelStreams(/*all=*/false);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto& t : threads) t.join();
  // Stream workers have no thread to join: their cancelled calls end on gRPC's threads,
  // soon. One that does not is a bug (a lost answer): say so rather than hang.
  const auto stuck = Clock::now() + std::chrono::seconds(30);
  while (active_workers_.load() > 0) {
    if (Clock::now() >= stuck) {
      std::fprintf(stderr, "decode_loadgen: %d stream workers still busy 30 s after their cancel\n",
                   active_workers_.load());
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Runner::Scheduler() {
  std::mt19937_64 rng(config_.seed ^ 0x5eed);
  std::exponential_distribution<double> gap(config_.rate);
  auto t = t0_;
  int64_t n = 0;
  while (true) {
    t += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
    if ((config_.requests > 0 && n >= config_.requests) || t >= end_) break;
    while (!stop_.load() && Clock::now() < t) {
      std::this_thread::sleep_until(std::min(t, Clock::now() + std::chrono::milliseconds(50)));
    }
    // Once stopped, arrivals due by the stop that this thread had not queued yet (it
    // wakes late) are still queued: they were not sent either, and count as such.
    if (stop_.load() && t > stop_time_) break;
    Worker* idle = nullptr;  // a stream worker waiting for this arrival
    {
      std::lock_guard<std::mutex> lock(mu_);
      tickets_.push_back(t);
      if (!idle_.empty()) {
        idle = idle_.back();
        idle_.pop_back();
      }
    }
    ++n;
    if (idle != nullptr) {
      StreamNext(idle);
    } else {
      cv_.notify_one();
    }
  }
  std::vector<Worker*> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_done_ = true;
    idle.swap(idle_);
  }
  cv_.notify_all();
  for (Worker* w : idle) StreamNext(w);  // the arrivals left, then the end
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
  DropStream(w);
  if (w->region != nullptr) {
    if (absl::Status s = client::UnregisterRegion(*w->client, w->region_name); !s.ok()) {
      std::fprintf(stderr, "decode_loadgen: unregistering %s: %s\n", w->region_name.c_str(),
                   s.ToString().c_str());
    }
  }
  --active_workers_;
}

void Runner::RecordSuccess(Worker* w, Clock::time_point intended, const client::BatchStats& b,
                           bool first_of_call) {
  w->consecutive_errors = 0;
  if (first_of_call) calls_ok_.fetch_add(1, std::memory_order_relaxed);
  token_layers_ok_.fetch_add(1, std::memory_order_relaxed);
  if (first_of_call) last_success_ns_ = w->call_end.time_since_epoch().count();
  if (!Measured(intended)) {
    if (first_of_call) ++w->stats.warmup_calls;
    return;
  }
  if (first_of_call) {
    w->stats.calls.push_back({Micros(intended - measure_start_), Micros(w->call_end - intended)});
  }
  ++w->stats.token_layers;
  w->stats.queue_us.push_back(b.queue_us);
  w->stats.compute_us.push_back(b.compute_us);
}

void Runner::RecordError(Worker* w, Clock::time_point intended, const absl::Status& s,
                         int64_t requests) {
  ++w->consecutive_errors;
  ++errors_;  // the stall detector's: warm-up errors count there too
  // Same window rule as the successes.
  if (!Measured(intended)) {
    w->stats.warmup_errors += requests;
    return;
  }
  w->stats.AddError(absl::StatusCodeToString(s.code()), std::string(s.message()), requests);
}

void Runner::Execute(Worker* w, Clock::time_point intended) {
  client::CallOptions call;
  call.timeout = std::chrono::milliseconds(config_.timeout_ms);
  for (size_t i = 0; i < w->seqs.size(); ++i) {
    workload_.FillDecode(w->seqs[i], w->cursors[i], w->rng, &w->inputs[i]);
  }
  if (config_.shm_transport) return ExecuteShm(w, intended, call);
  if (config_.mode == Mode::kBatch) {
    auto r = w->client->DecodeBatch(w->inputs, call);
    w->call_end = Clock::now();
    // The unit is the request: a failed RPC fails each of its requests.
    if (!r.ok()) return RecordError(w, intended, r.status(), std::ssize(w->inputs));
    bool first = true;
    for (size_t i = 0; i < r->size(); ++i) {
      if (!(*r)[i].ok()) {
        RecordError(w, intended, (*r)[i].status());
        continue;
      }
      RecordSuccess(w, intended, (*r)[i]->batch, first);
      first = false;
      workload_.Advance(&w->cursors[i]);
    }
    return;
  }
  absl::StatusOr<client::DecodeOutput> r =
      config_.mode == Mode::kUnary ? w->client->Decode(w->inputs[0], call) : StreamCall(w);
  w->call_end = Clock::now();
  if (!r.ok()) return RecordError(w, intended, r.status());
  RecordSuccess(w, intended, r->batch, true);
  workload_.Advance(&w->cursors[0]);
}

absl::Status Runner::SetUpRegion(Worker* w) {
  absl::StatusOr<client::Shape> shape = w->client->GetShape();
  if (!shape.ok()) return shape.status();
  const size_t b = w->inputs.size();
  const size_t q_row = size_t{2} * shape->num_q_heads * shape->head_dim;
  const size_t kv_row = size_t{2} * shape->num_kv_heads * shape->head_dim;
  const size_t idx_row =
      size_t{4} * config_.topk * (config_.per_head_indices ? shape->num_kv_heads : 1);
  // q, gate, k, v, indices, out: each starts on a 256-byte boundary.
  const size_t sizes[] = {b * q_row, b * q_row, b * kv_row, b * kv_row, b * idx_row, b * q_row};
  std::vector<uint64_t> offsets;
  uint64_t at = 0;
  for (size_t bytes : sizes) {
    offsets.push_back(at);
    at += (bytes + 255) / 256 * 256;
  }
  absl::StatusOr<std::unique_ptr<client::SharedMemoryRegion>> region =
      client::SharedMemoryRegion::Create(at);
  if (!region.ok()) return region.status();
  w->region_name = absl::StrCat("loadgen-", getpid(), "-", w->index);
  if (absl::Status s = client::RegisterSystemRegion(*w->client, w->region_name, **region); !s.ok())
    return s;
  w->region = *std::move(region);
  client::LayerBatch& l = w->layer;
  client::RegionSlice* slices[] = {&l.q, &l.gate, &l.k, &l.v, &l.indices, &l.out};
  for (size_t i = 0; i < 6; ++i) *slices[i] = {w->region_name, offsets[i], 0};
  l.topk = config_.topk;
  l.per_kv_head_indices = config_.per_head_indices;
  return absl::OkStatus();
}

void Runner::ExecuteShm(Worker* w, Clock::time_point intended, const client::CallOptions& call) {
  if (w->region == nullptr) {
    if (absl::Status s = SetUpRegion(w); !s.ok()) {
      w->call_end = Clock::now();
      return RecordError(w, intended, s, std::ssize(w->inputs));
    }
  }
  // Items whose cursors are at another layer (an earlier failure held them back) go in a
  // call of their own: a DecodeLayer call is one layer.
  std::vector<int32_t> layers;
  for (const client::DecodeInput& in : w->inputs) {
    if (std::find(layers.begin(), layers.end(), in.layer) == layers.end())
      layers.push_back(in.layer);
  }
  bool first = true;
  client::LayerBatch& l = w->layer;
  char* base = w->region->data();
  for (int32_t layer : layers) {
    std::vector<size_t> items;
    for (size_t i = 0; i < w->inputs.size(); ++i)
      if (w->inputs[i].layer == layer) items.push_back(i);
    l.layer = layer;
    l.sequence_ids.clear();
    l.positions.clear();
    const size_t n = items.size();
    size_t row = 0;
    for (size_t i : items) {
      const client::DecodeInput& in = w->inputs[i];
      l.sequence_ids.push_back(in.sequence_id);
      l.positions.push_back(in.position);
      const auto put = [&](const client::RegionSlice& s, const void* src, size_t bytes) {
        std::memcpy(base + s.offset + row * bytes, src, bytes);
      };
      put(l.q, in.q.data(), in.q.size() * 2);
      put(l.gate, in.gate.data(), in.gate.size() * 2);
      put(l.k, in.k.data(), in.k.size() * 2);
      put(l.v, in.v.data(), in.v.size() * 2);
      put(l.indices, in.indices.data(), in.indices.size() * 4);
      ++row;
    }
    const client::DecodeInput& one = w->inputs[items[0]];
    l.q.bytes = l.gate.bytes = l.out.bytes = n * one.q.size() * 2;
    l.k.bytes = l.v.bytes = n * one.k.size() * 2;
    l.indices.bytes = n * one.indices.size() * 4;
    absl::StatusOr<client::LayerResult> r = client::DecodeLayer(*w->client, l, call);
    w->call_end = Clock::now();
    if (!r.ok()) {
      RecordError(w, intended, r.status(), static_cast<int64_t>(n));
      continue;
    }
    for (size_t j = 0; j < n; ++j) {
      if (!r->items[j].ok()) {
        RecordError(w, intended, r->items[j]);
        continue;
      }
      RecordSuccess(w, intended, r->batch, first);
      first = false;
      workload_.Advance(&w->cursors[items[j]]);
    }
  }
}

}  // namespace sds::loadgen
