// Drives the decode calls: closed loop (N callers back to back) or open loop (Poisson
// arrivals; latency from each call's intended send time, so a slow server cannot hide
// its queueing: no coordinated omission). Arrivals still unsent when the run stops are
// charged their wait so far, for the same reason.
// Unary and DecodeBatch workers are threads (the synchronous API), and so are stream
// workers with --stream_api=sync (a SingleCallStream each). With the callback API
// stream workers have no thread: each drives a ReactorStream, and issues its next call
// from the callback that delivered the last answer (on a gRPC thread), or from the
// scheduler thread when an open loop's arrival finds it idle, or from Run's thread
// after an error's back-off.
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
#include "client/loadgen/reactor_stream.h"
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
  // Stopped early by SIGINT/SIGTERM (stop_signal.h): a partial run, never a pass.
  bool interrupted = false;
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

  // Test seam: called right after each stream call's answer arrives, before the worker
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
  // --transport=shm: the worker's batch as DecodeLayer calls (one per layer its items
  // are at) with the tensors copied into its shared-memory region first.
  void ExecuteShm(Worker* w, Clock::time_point intended, const client::CallOptions& call);
  absl::Status SetUpRegion(Worker* w);
  // A stream call on the worker's thread (--stream_api=sync).
  absl::StatusOr<client::DecodeOutput> StreamCall(Worker* w);
  bool StreamsOnCallbacks() const {
    return config_.mode == Mode::kStream && config_.stream_api == StreamApi::kCallback;
  }
  // Stream workers on callbacks (no thread): the worker's next call, or its end when the run has no
  // more for it; in an open loop with no arrival due it waits in idle_.
  void StreamNext(Worker* w);
  enum class Ticket { kGot, kIdle, kDone };
  Ticket TakeStreamTicket(Worker* w, Clock::time_point* intended);
  void StreamIssue(Worker* w, Clock::time_point intended);
  void StreamAnswered(Worker* w, absl::StatusOr<client::DecodeOutput> r);
  // The stream call's result once claimed back from CancelStreams (as the worker's
  // error when the stream was cancelled), replacing a stream of no further use.
  absl::StatusOr<client::DecodeOutput> ClaimStreamCall(Worker* w,
                                                       absl::StatusOr<client::DecodeOutput> r);
  // After a failed call: StreamNext once the back-off has passed (Run's loop issues it).
  void StreamBackOff(Worker* w);
  void FinishStreamWorker(Worker* w);
  // Stream workers due after their back-off, for Run's loop to go on with.
  std::vector<Worker*> DueBackOffs(Clock::time_point now);
  // Stops stream workers that wait (idle or backing off): the run is over for them.
  void FinishWaitingStreamWorkers();
  // Installs the worker's stream (one of `s` and `sync`, or neither: none), releasing
  // the one it had.
  void ReplaceStream(Worker* w, ReactorStream::Ptr s, std::unique_ptr<SingleCallStream> sync);
  void DropStream(Worker* w) { ReplaceStream(w, nullptr, nullptr); }
  // The worker's stream's status (OK: healthy); the worker's flow only.
  static absl::Status StreamStatus(Worker* w);
  // Cancels the workers' streams: with `all`, every one (and any opened later); else
  // those whose current call has outlived --timeout_ms.
  void CancelStreams(bool all);
  // Stops the workers and joins them (stream workers: waits for them to finish);
  // `abort`: cancel their streams at once, else let the calls in flight end (each within
  // its timeout) first.
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
  // The workers' streams; declared before the workers, so destroyed after them (and
  // ~Runner waits for the streams to end first).
  ReactorStream::Group streams_;
  std::vector<std::unique_ptr<Worker>> workers_;
  Clock::time_point t0_, measure_start_, end_;
  Clock::time_point stop_time_;  // set (under mu_) before stop_
  std::atomic<bool> stop_{false};
  std::atomic<bool> cancel_all_streams_{false};
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> last_success_ns_{0};
  std::atomic<int64_t> errors_{0};
  // Successes so far, warm-up included, for the progress lines (the workers' stats are
  // theirs alone until merged at the end).
  std::atomic<int64_t> calls_ok_{0};
  std::atomic<int64_t> token_layers_ok_{0};
  std::atomic<int> active_workers_{0};
  // Open loop arrivals.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Clock::time_point> tickets_;
  bool generation_done_ = false;
  // Stream workers waiting for an open loop's arrival, and backing off (guarded by mu_).
  std::vector<Worker*> idle_;
  std::vector<std::pair<Clock::time_point, Worker*>> backing_off_;
  std::condition_variable backoff_cv_;  // Run's loop waits on it for the next back-off's end
  std::function<void()> after_stream_call_for_test_;
};

}  // namespace sds::loadgen
