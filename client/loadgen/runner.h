// Drives the decode calls: closed loop (N callers back to back) or open loop (Poisson
// arrivals; latency from each call's intended send time, so a slow server cannot hide
// its queueing: no coordinated omission).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "client/decode_client.h"
#include "client/loadgen/config.h"
#include "client/loadgen/stats.h"
#include "client/loadgen/workload.h"

namespace sds::loadgen {

using Clock = std::chrono::steady_clock;

struct RunResult {
  WorkerStats stats;
  double measured_s = 0;
  int64_t not_sent = 0;  // open loop: arrivals still queued when the run ended
  bool aborted = false;
  std::string abort_reason;
};

class Runner {
 public:
  Runner(const Config& config, const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
         const Workload& workload);
  RunResult Run();

 private:
  struct Worker;
  void WorkerLoop(Worker* w);
  void Scheduler();
  bool NextTicket(Clock::time_point* intended);
  void Execute(Worker* w, Clock::time_point intended);
  void RecordSuccess(Worker* w, Clock::time_point intended, const client::BatchStats& b,
                     bool first_of_call);
  void RecordError(Worker* w, const absl::Status& s);
  bool Measured(Clock::time_point t) const { return t >= measure_start_; }

  const Config& config_;
  const std::vector<std::unique_ptr<client::DecodeClient>>& clients_;
  const Workload& workload_;
  Clock::time_point t0_, measure_start_, end_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> last_success_ns_{0};
  std::atomic<int64_t> errors_{0};
  std::atomic<int> active_workers_{0};
  // Open loop arrivals.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Clock::time_point> tickets_;
  bool generation_done_ = false;
};

}  // namespace sds::loadgen
