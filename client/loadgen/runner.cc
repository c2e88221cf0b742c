#include "client/loadgen/runner.h"

#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/loadgen/runner_worker.h"

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
