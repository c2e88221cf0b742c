#include "client/loadgen/runner.h"

#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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
  std::mt19937_64 rng;
  WorkerStats stats;
  int consecutive_errors = 0;
  Clock::time_point call_end;
  // The open stream (stream mode). Only the worker's flow replaces it, always under
  // stream_mu, so that the runner can cancel it (CancelStreams) while a call is in it.
  std::mutex stream_mu;
  ReactorStream::Ptr stream;                      // --stream_api=callback
  std::unique_ptr<SingleCallStream> sync_stream;  // --stream_api=sync
  Clock::time_point intended;                     // of the callback stream's call in flight
  bool stream_cancelled = false;                  // by the runner; guarded by stream_mu
  // Start of the stream call in flight; 0: none. Set by the worker alone; reset by it
  // under stream_mu once the call returned, which is how it claims the call back from
  // CancelStreams (which reads it under stream_mu too).
  std::atomic<int64_t> stream_call_ns{0};
};

namespace {

// A stream call has no deadline of its own (either stream kind): the runner cancels its
// stream once the call has taken --timeout_ms and this slack, which ends a slow answer's
// read and a write the server does not take alike.
constexpr auto kStreamCallSlack = std::chrono::milliseconds(100);

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

void Runner::ReplaceStream(Worker* w, ReactorStream::Ptr s,
                           std::unique_ptr<SingleCallStream> sync) {
  // Released after the unlock: each cancels its stream (a SingleCallStream also waits
  // for its final status).
  ReactorStream::Ptr old;
  std::unique_ptr<SingleCallStream> old_sync;
  std::lock_guard<std::mutex> lock(w->stream_mu);
  old = std::move(w->stream);
  old_sync = std::move(w->sync_stream);
  w->stream = std::move(s);
  w->sync_stream = std::move(sync);
  w->stream_cancelled = false;
  // Opened after CancelStreams(true) went by this worker: it would not come back.
  if ((w->stream || w->sync_stream) && cancel_all_streams_.load()) {
    if (w->stream) w->stream->Cancel();
    if (w->sync_stream) w->sync_stream->Cancel();
    w->stream_cancelled = true;
  }
}

absl::Status Runner::StreamStatus(Worker* w) {
  if (w->stream) return w->stream->status();
  if (w->sync_stream) return w->sync_stream->status();
  return absl::OkStatus();
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
  // Stream workers have no thread to join: their cancelled calls end on gRPC's threads.
  while (active_workers_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void Runner::CancelStreams(bool all) {
  if (all) cancel_all_streams_ = true;
  const int64_t now = Clock::now().time_since_epoch().count();
  const int64_t limit = std::chrono::duration_cast<Clock::duration>(
                            std::chrono::milliseconds(config_.timeout_ms) + kStreamCallSlack)
                            .count();
  for (auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->stream_mu);
    if ((!w->stream && !w->sync_stream) || w->stream_cancelled) continue;
    const int64_t start = w->stream_call_ns.load();
    if (all || (start != 0 && now - start > limit)) {
      if (w->stream) w->stream->Cancel();
      if (w->sync_stream) w->sync_stream->Cancel();
      w->stream_cancelled = true;
    }
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

absl::StatusOr<client::DecodeOutput> Runner::StreamCall(Worker* w) {
  if (!w->sync_stream) {
    auto s = SingleCallStream::Open(w->client);
    if (!s.ok()) return s.status();
    ReplaceStream(w, nullptr, *std::move(s));
  }
  w->stream_call_ns = Clock::now().time_since_epoch().count();
  auto r = w->sync_stream->Call(w->inputs[0]);
  if (after_stream_call_for_test_) after_stream_call_for_test_();
  return ClaimStreamCall(w, std::move(r));
}

Runner::Ticket Runner::TakeStreamTicket(Worker* w, Clock::time_point* intended) {
  if (config_.rate <= 0) {
    if (stop_.load()) return Ticket::kDone;
    if (config_.requests > 0 && issued_.fetch_add(1) >= config_.requests) return Ticket::kDone;
    *intended = Clock::now();
    return Ticket::kGot;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_.load()) return Ticket::kDone;
  if (!tickets_.empty()) {
    *intended = tickets_.front();
    tickets_.pop_front();
    return Ticket::kGot;
  }
  if (generation_done_) return Ticket::kDone;
  idle_.push_back(w);  // the scheduler's next arrival goes on with it
  return Ticket::kIdle;
}

void Runner::StreamNext(Worker* w) {
  Clock::time_point intended;
  switch (TakeStreamTicket(w, &intended)) {
    case Ticket::kGot:
      return StreamIssue(w, intended);
    case Ticket::kIdle:
      return;
    case Ticket::kDone:
      return FinishStreamWorker(w);
  }
}

void Runner::FinishStreamWorker(Worker* w) {
  DropStream(w);
  --active_workers_;  // last: Run may merge the worker's stats from here on
}

void Runner::StreamIssue(Worker* w, Clock::time_point intended) {
  w->intended = intended;
  workload_.FillDecode(w->seqs[0], w->cursors[0], w->rng, &w->inputs[0]);
  if (!w->stream) {
    auto s = ReactorStream::Open(w->client, &streams_);
    if (!s.ok()) {
      w->call_end = Clock::now();
      RecordError(w, intended, s.status());
      return StreamBackOff(w);
    }
    ReplaceStream(w, *std::move(s), nullptr);
  }
  w->stream_call_ns = Clock::now().time_since_epoch().count();
  // The answer comes on a gRPC thread, or at once when the call fails before it is sent.
  w->stream->Call(w->inputs[0], [this, w](absl::StatusOr<client::DecodeOutput> r) {
    StreamAnswered(w, std::move(r));
  });
}

void Runner::StreamAnswered(Worker* w, absl::StatusOr<client::DecodeOutput> r) {
  if (after_stream_call_for_test_) after_stream_call_for_test_();
  r = ClaimStreamCall(w, std::move(r));
  w->call_end = Clock::now();
  if (!r.ok()) {
    RecordError(w, w->intended, r.status());
    return StreamBackOff(w);
  }
  RecordSuccess(w, w->intended, r->batch, true);
  workload_.Advance(&w->cursors[0]);
  StreamNext(w);
}

absl::StatusOr<client::DecodeOutput> Runner::ClaimStreamCall(
    Worker* w, absl::StatusOr<client::DecodeOutput> r) {
  bool cancelled;
  {
    // Claims the call back: from here CancelStreams sees no call in flight, and before
    // here it may have cancelled the stream, even after the answer arrived.
    std::lock_guard<std::mutex> lock(w->stream_mu);
    w->stream_call_ns = 0;
    cancelled = w->stream_cancelled;
  }
  if (r.ok()) {
    // Answered, though the stream was cancelled meanwhile (the call was slow, or the
    // run is ending): the answer counts, the stream is of no further use.
    if (cancelled) DropStream(w);
    return r;
  }
  // A broken, stuck or cancelled stream is replaced; a request that failed alone is not.
  if (cancelled || !StreamStatus(w).ok() ||
      r.status().code() == absl::StatusCode::kDeadlineExceeded) {
    DropStream(w);
  }
  if (cancelled) {
    return absl::DeadlineExceededError(
        absl::StrCat(cancel_all_streams_.load() ? "stream call cut off at the end of the run"
                                                : "stream call not done within --timeout_ms",
                     " (a write waits while the server does not read); stream cancelled: ",
                     r.status().ToString()));
  }
  return r;
}

void Runner::StreamBackOff(Worker* w) {
  // Back off a failing server a little, as the threads of the other modes do; a dead one
  // then costs no CPU.
  const int shift = std::min(w->consecutive_errors, 7);
  const auto due = Clock::now() + std::chrono::milliseconds(1 << shift);
  bool stopped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped = stop_.load();
    if (!stopped) backing_off_.emplace_back(due, w);
  }
  if (stopped) return StreamNext(w);  // its end
  backoff_cv_.notify_one();
}

std::vector<Runner::Worker*> Runner::DueBackOffs(Clock::time_point now) {
  std::vector<Worker*> due;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < backing_off_.size();) {
    if (backing_off_[i].first <= now) {
      due.push_back(backing_off_[i].second);
      backing_off_[i] = backing_off_.back();
      backing_off_.pop_back();
    } else {
      ++i;
    }
  }
  return due;
}

void Runner::FinishWaitingStreamWorkers() {
  std::vector<Worker*> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);  // stop_ is set: none is added from here on
    waiting.swap(idle_);
    for (const auto& b : backing_off_) waiting.push_back(b.second);
    backing_off_.clear();
  }
  for (Worker* w : waiting) FinishStreamWorker(w);
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

}  // namespace sds::loadgen
