// Drives the decode calls: closed loop (N callers back to back) or open loop (Poisson
// arrivals; latency from each call's intended send time, so a slow server cannot hide
// its queueing: no coordinated omission). Arrivals still unsent when the run stops are
// charged their wait so far, for the same reason.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "client/decode_client.h"
#include "client/loadgen/config.h"
#include "client/loadgen/single_call_stream.h"
#include "client/loadgen/stats.h"
#include "client/loadgen/workload.h"

namespace sds::loadgen {

using Clock = std::chrono::steady_clock;

struct RunResult {
  WorkerStats stats;
  double measured_s = 0;
  // Open loop: arrivals due before the run stopped that were never sent (the workers,
  // all busy with a slow server, never got to them).
  int64_t not_sent = 0;
  // Those of them due in the measured window, each charged the lower bound of its
  // latency: stop time - intended send time. Reported with the calls' latencies, else an
  // overloaded server would hide its worst queueing (coordinated omission at the end).
  std::vector<Sample> not_sent_charged;
  bool aborted = false;
  std::string abort_reason;
  // This process's CPU time (all its threads) over the measured window, in cores; < 0
  // when the run ended before the window began. On a host shared with the server it
  // shows how much of the machine the client itself took.
  double client_cpu_cores = -1;
};

class Runner {
 public:
  Runner(const Config& config, const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
         const Workload& workload);
  ~Runner();
  RunResult Run();

  // Test seam: called by a worker right after each stream call returns, before it
  // claims the call back from the stream canceller. Set before Run.
  void SetAfterStreamCallForTest(std::function<void()> hook) {
    after_stream_call_for_test_ = std::move(hook);
  }

 private:
  struct Worker;
  void WorkerLoop(Worker* w);
  void Scheduler();
  bool NextTicket(Clock::time_point* intended);
  void Execute(Worker* w, Clock::time_point intended);
  absl::StatusOr<client::DecodeOutput> StreamCall(Worker* w);
  // Installs `s` as the worker's stream (nullptr: none).
  void ReplaceStream(Worker* w, std::unique_ptr<SingleCallStream> s);
  // Cancels the workers' streams: with `all`, every one (and any opened later); else
  // those whose current call has outlived --timeout_ms.
  void CancelStreams(bool all);
  // Stops the workers and joins them; `abort`: cancel their streams at once, else let
  // the calls in flight end (each within its timeout) first.
  void StopWorkers(std::vector<std::thread>& threads, bool abort);
  void RecordSuccess(Worker* w, Clock::time_point intended, const client::BatchStats& b,
                     bool first_of_call);
  // `requests`: how many requests (token-layers) the failure stands for.
  void RecordError(Worker* w, Clock::time_point intended, const absl::Status& s,
                   int64_t requests = 1);
  bool Measured(Clock::time_point t) const { return t >= measure_start_; }

  const Config& config_;
  const std::vector<std::unique_ptr<client::DecodeClient>>& clients_;
  const Workload& workload_;
  std::vector<std::unique_ptr<Worker>> workers_;
  Clock::time_point t0_, measure_start_, end_;
  Clock::time_point stop_time_;  // set (under mu_) before stop_
  std::atomic<bool> stop_{false};
  std::atomic<bool> cancel_all_streams_{false};
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> last_success_ns_{0};
  std::atomic<int64_t> errors_{0};
  std::atomic<int> active_workers_{0};
  // Open loop arrivals.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Clock::time_point> tickets_;
  bool generation_done_ = false;
  std::function<void()> after_stream_call_for_test_;
};

}  // namespace sds::loadgen
