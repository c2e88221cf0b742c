// The dynamic batcher: one queue for every decode unit (work.h: a Decode call, a
// DecodeStream message, or a DecodeBatch or DecodeLayer call's items, from all
// connections), prefill and cache-control work.
//
// Two threads. The assembler waits for a free staging buffer (two, so one fills while
// the other runs), then closes a batch when it reaches max_batch_size or when its
// oldest request has waited max_queue_delay, and copies the request tensors into the
// staging buffer. The executor runs batches, prefills and control work in queue order.
// When the executor thread is idle the assembler runs the unit itself (one unit at a
// time either way): a hand-over then buys no overlap and costs a context switch.
// With `run_on_submitter` (and `eager`), a decode submitted into an idle batcher (no
// unit running or handed over, none held by the assembler) is run by the submitting
// thread itself, with whatever else closes with it: on the CPU backend that saves the
// assembler's wake-up, and a DecodeStream answer is then written from inside a gRPC
// reaction. Units still run one at a time, in queue order.
// A batch takes whole units, in queue order, up to max_batch_size items, and at most one
// decode per (sequence, layer): a unit with a pair the batch holds stays queued, in
// order, for a later batch. With `eager`, a batch also closes at once when it holds the
// last unit of a multi-item call (`DecodeWork::closes_batch`: the runner sent its whole
// batch) or when the executor has no batch (an idle executor gains nothing by
// waiting). With max_concurrent_batches > 1 (a backend with several lanes) that many
// executor threads run decode batches side by side, each batch free of the sequences of
// the others; the eager close then waits only for a free lane.
// A decode batch frees its staging buffer and its executor thread once its cache writes
// are committed and its answers encoded, before its completions run: work queued after
// it (a batch, a prefill, a fork or release) may then start, and be answered, before
// that batch's answers are sent.
// Critical sections only move queue entries; condition variables are
// notified after the lock is released, and only when the waiter's decision can change
// (a queue that was empty, a full batch, a non-decode entry, a finished batch).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu_thread_pool.h"
#include "server/executor.h"
#include "server/staging.h"
#include "server/work.h"

namespace sds::server {

struct BatcherOptions {
  int32_t max_batch_size = 64;
  std::chrono::microseconds max_queue_delay{500};
  int32_t max_queue_depth = 4096;  // decode items (of all units) and prefills waiting
  bool eager = false;  // close at once while the executor is idle or on a DecodeBatch's end
  // With eager: a submitting thread that finds the batcher idle (nothing queued or held
  // by the assembler, no unit running) runs the batch itself instead of waking the
  // assembler.
  bool run_on_submitter = false;
  // Threads that copy a batch's request tensors into staging (the caller included): a
  // DecodeBatch of 256 seed-shape requests is ~5.8 MB of copies before anything runs.
  // 1 = the assembling thread alone.
  int32_t staging_threads = 1;
  // How long the assembler and executor threads spin for new work before they sleep
  // (spin_wait.h), and an eager assembler for the batch in flight to end; 0 = sleep at
  // once.
  std::chrono::microseconds idle_spin{0};
  // Decode batches that may run at once (each on its own executor thread, for a
  // backend that runs concurrent batches on separate lanes: Backend::max_concurrent_runs).
  // A batch then holds no sequence that a batch in flight holds (its page table and
  // copy-on-write stay with the one batch), and fork/release and prefill units still run
  // alone. Needs max_concurrent_batches + 1 staging buffers to keep one filling.
  int32_t max_concurrent_batches = 1;
  // Tests only: called by the releasing thread as the last step of every unit's release
  // (its staging buffer free, its items counted as completed).
  std::function<void()> after_unit_release_for_test;
};

class Batcher {
 private:
  using Entry = std::variant<DecodeWork, AppendWork, ControlWork>;
  struct Ready {  // what the assembler hands to the executor
    int buffer = -1;
    std::vector<DecodeWork> decodes;  // units
    std::unique_ptr<Entry> single;    // an AppendWork or ControlWork
  };

 public:
  // A batch that a decode's submitter claimed (run_on_submitter), to be run by the
  // same thread after its own bookkeeping. Until it has run, every other unit waits
  // (one unit at a time). A DecodeStream runs it before starting its next read: gRPC
  // would deliver that read only after the reaction returns anyway, so a pipelining
  // stream is instead kept from claiming (stream_reactor.cc). Run() runs it once and
  // leaves the claim fresh; the destructor runs it if Run() was not called. Run() does
  // not throw: a failing completion or staging copy is logged and the unit released.
  class SubmitterRun {
   public:
    SubmitterRun() = default;
    SubmitterRun(const SubmitterRun&) = delete;
    SubmitterRun& operator=(const SubmitterRun&) = delete;
    ~SubmitterRun() { Run(); }
    void Run();

   private:
    friend class Batcher;
    Batcher* batcher_ = nullptr;  // set when there is something to run
    Ready ready_;
    std::vector<DecodeWork> expired_;
  };

  // Takes the staging buffers (sized for options.max_batch_size): at least two, and
  // options.max_concurrent_batches + 1 for concurrent batches to overlap their filling.
  Batcher(const BatcherOptions& options, Executor* executor,
          std::vector<std::unique_ptr<StagingBuffer>> staging);
  ~Batcher();  // Stop()

  void Start();
  // On error (queue full: RESOURCE_EXHAUSTED; stopped: UNAVAILABLE; a unit of no items
  // or more than max_batch_size: INTERNAL) nothing was queued and the unit will not be
  // completed. The same when one of them throws (bad_alloc).
  // With run_on_submitter and `claim`, the batch may be claimed for this thread: it
  // runs when the caller runs (or destroys) `claim`. Without `claim` it never is.
  absl::Status SubmitDecode(DecodeWork work, SubmitterRun* claim = nullptr);
  // Queues several decode units under one lock, in order. Returns one status per unit; a
  // unit that was queued is moved from (it will be completed), a refused one is left
  // intact for the caller to answer. Throws (bad_alloc) only before queueing any.
  std::vector<absl::Status> SubmitDecodes(std::vector<DecodeWork>* works);
  absl::Status SubmitAppend(AppendWork work);
  // Not limited by max_queue_depth. FIFO with everything else, unless `urgent`: then it
  // runs before every queued decode (after earlier urgent work), at the next batch
  // boundary; release uses this so that queued requests of a released sequence fail
  // NOT_FOUND instead of delaying the release.
  absl::Status SubmitControl(ControlWork work, bool urgent = false);

  // Closes batches without waiting for the queue delay and waits until every
  // submitted item has completed or `deadline` passed. True when all completed.
  bool Drain(Clock::time_point deadline);
  // Joins the threads; items still queued fail with UNAVAILABLE.
  void Stop();

  int64_t queue_depth() const;
  // The most items one decode unit may hold.
  int32_t max_batch_size() const { return options_.max_batch_size; }

 private:
  // `claim`: a decode submission, which may claim the batch for the submitting thread
  // (BatcherOptions::run_on_submitter); null for others.
  absl::Status Enqueue(Entry entry, bool counts_toward_depth, bool urgent, SubmitterRun* claim);
  // Requires queue_mu_. Admission check and push; true when the assembler should wake.
  absl::Status PushLocked(Entry& entry, bool counts_toward_depth, bool urgent, bool* wake);
  void AssemblerLoop();
  void ExecutorLoop();
  // Runs one unit (on the executor thread, or on the assembler's while the executor
  // thread is idle) and answers it (INTERNAL when running it throws), then frees its
  // staging buffer and accounts for it. A fork/release whose deadline passed or whose
  // call was cancelled is answered without running (a prefill's check is the executor's).
  void RunReady(Ready& ready);
  // The end of every unit, run or not: ReleaseResources, then FinishUnit.
  void ReleaseUnit(Ready& ready, int64_t items);
  // Requires pipe_mu_. Whether `ready` may start now: a decode batch while fewer than
  // max_concurrent_batches decode batches run and no other unit does; any other unit
  // only when nothing runs.
  bool CanStartLocked(const Ready& ready) const;
  // Requires pipe_mu_. Counts `ready` as running.
  void MarkRunningLocked(const Ready& ready);
  // Requires queue_mu_. The sequences of decode batches in flight
  // (max_concurrent_batches > 1 only): add a batch's (decodes[first..]) or remove them.
  void AddInFlightSequencesLocked(const std::vector<DecodeWork>& decodes, size_t first);
  void RemoveInFlightSequencesLocked(const std::vector<DecodeWork>& decodes);
  // The unit no longer running, the staging buffer freed, a decode batch (and its
  // sequences) no longer in flight, waiters woken. A decode batch's run calls it before its
  // completions (Executor::RunDecodeBatch's before_answers), so the next unit may run meanwhile.
  void ReleaseResources(const Ready& ready);
  // After the unit's completions: `items` accounted as completed (Drain), the test hook.
  void FinishUnit(int64_t items);
  // ClaimForSubmitterLocked that never throws: false (the work stays queued) on error.
  bool TryClaimLocked(SubmitterRun* claim);
  bool QueueNonEmpty() const;
  // Waits until a batch may close, then takes it (or one non-decode entry).
  // False when stopping and the queue is empty.
  bool TakeWork(std::vector<DecodeWork>* decodes, std::unique_ptr<Entry>* single,
                std::vector<DecodeWork>* expired);
  // Requires queue_mu_ and a decode at the front. Takes the batch that may close now
  // (true), or says until when to wait (false).
  bool TakeBatchLocked(Clock::time_point now, std::vector<DecodeWork>* decodes,
                       std::vector<DecodeWork>* expired, Clock::time_point* wait_until);
  // Requires queue_mu_ (takes pipe_mu_). True when the submitting thread may run the
  // batch that closes now: it is taken into `ready` with a staging buffer and the
  // executor marked running.
  // Expired requests it took are answered by `claim`'s run as well.
  bool ClaimForSubmitterLocked(SubmitterRun* claim);
  // Answers the expired requests, fills the staging rows and runs the batch; then the
  // claim is done with this batcher (ClaimDone).
  void RunClaimed(SubmitterRun* claim);
  void RunClaimedUnit(SubmitterRun* claim);
  // The last touch of a claim's run: claims_in_flight_ down, Stop woken.
  void ClaimDone();
  // Lists the items of `ready` (rows_ of its buffer) and copies their tensors into its
  // staging buffer rows: on the fill pool for batches of at least 16 items when no other
  // fill holds it, else on this thread. PlanIndices and FillRow only sum sizes and copy
  // bytes, and the list has its room, so neither way throws.
  void FillStaging(const Ready& ready);
  void AddOutstanding(int64_t items);
  void Completed(int64_t items);

  const BatcherOptions options_;
  Executor* const executor_;
  std::vector<std::unique_ptr<StagingBuffer>> staging_;
  // Per staging buffer: the items of its batch in row order (FillStaging), reserved for
  // max_batch_size so that filling allocates nothing.
  std::vector<std::vector<const DecodeItem*>> rows_;
  // BatcherOptions::staging_threads > 1: the fill pool, one fill at a time (the
  // assembler's and a claimed batch's may overlap; the later one copies on its own).
  std::unique_ptr<CpuThreadPool> fill_pool_;
  std::mutex fill_pool_mu_;

  mutable std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Entry> queue_;
  int64_t limited_in_queue_ = 0;  // decode items + append entries in queue_
  size_t urgent_in_front_ = 0;    // urgent control entries at the front of queue_
  bool draining_ = false;
  bool stopping_ = false;
  // TakeBatchLocked's scratch, kept for its capacity (guarded by queue_mu_).
  enum class ScanAction : char { kKeep, kTake, kExpire };
  std::vector<ScanAction> scan_actions_;
  absl::flat_hash_set<std::pair<absl::string_view, int32_t>> scan_seen_;
  // max_concurrent_batches > 1: how many in-flight decode batches hold each sequence,
  // by the hash of its id (a collision only holds a request back for a batch).
  absl::flat_hash_map<uint64_t, int> in_flight_sequences_;

  std::mutex pipe_mu_;
  std::condition_variable buffer_cv_;  // the assembler waits for a free staging buffer
  std::condition_variable ready_cv_;   // the executor waits for work
  std::vector<int> free_buffers_;
  std::deque<Ready> ready_;
  int running_ = 0;             // units running (on any thread)
  bool running_alone_ = false;  // the one running unit is not a decode batch
  // Claims whose submitting thread has yet to finish running them (their runs still
  // touch this batcher after the unit is released); Stop waits for 0.
  int claims_in_flight_ = 0;
  // The assembler took work from the queue and has not yet run or handed it over
  // (set under queue_mu_, cleared under pipe_mu_; read under both).
  bool assembler_holding_ = false;
  bool assembler_done_ = false;
  std::atomic<int> batches_in_flight_{0};  // decode batches handed to the executor, not done
  // SpinThenWait's `events`, bumped under the mutex of the state they announce, on their
  // own cache lines (the spinning thread reads them in a loop): queue_events_ when an
  // entry is pushed or the batcher drains or stops (queue_mu_), pipe_events_ when ready_,
  // running_ or assembler_done_ change (pipe_mu_).
  alignas(64) std::atomic<uint64_t> queue_events_{0};
  alignas(64) std::atomic<uint64_t> pipe_events_{0};

  std::mutex outstanding_mu_;
  std::condition_variable outstanding_cv_;
  int64_t outstanding_ = 0;  // submitted, not yet completed

  std::thread assembler_;
  std::vector<std::thread> executor_threads_;  // max_concurrent_batches of them
  bool started_ = false;
};

}  // namespace sds::server
