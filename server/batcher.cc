#include "server/batcher.h"

#include <pthread.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/spin_wait.h"
#include "spdlog/spdlog.h"

namespace sds::server {
namespace {

absl::Status Expired() {
  return absl::DeadlineExceededError(
      "deadline passed while the request waited in the queue; it was not run");
}

absl::Status Stopped() {
  return absl::UnavailableError("server is draining: the request was not run");
}

// Built once, on the first call (a Status with a message is a heap allocation, not to
// be made per call on the decode path); copies only count a reference. Never destroyed:
// no exit-time destructor.
const absl::Status& QueueOutOfMemory() {
  static const absl::Status* const status = new absl::Status(
      absl::InternalError("internal error: out of memory while queueing the request"));
  return *status;
}

// Answers units that were taken from the queue but not run. A completion that throws is
// a bug; it is logged and the others are still answered.
void AnswerAll(std::vector<DecodeWork>& works, const absl::Status& status) {
  for (DecodeWork& d : works) {
    try {
      Complete(d, {&status, 1});
    } catch (const std::exception& e) {
      // Not its items' keys: a completion may have freed them before it threw.
      spdlog::critical("batcher: exception from the completion of a unit of {}: {}", d.items.size(),
                       e.what());
    }
  }
}

// Calls one unit's completion; a completion that throws is a bug: it is logged, and
// the unit is not answered again (it may have been answered before the throw).
template <typename Done>
void Answer(const char* what, Done&& done) {
  try {
    done();
  } catch (const std::exception& e) {
    spdlog::critical("batcher: exception from the completion of a {}: {}", what, e.what());
  }
}

void FailEntry(std::variant<DecodeWork, AppendWork, ControlWork>& entry,
               const absl::Status& status) {
  if (auto* d = std::get_if<DecodeWork>(&entry))
    Answer("decode", [&] { Complete(*d, {&status, 1}); });
  if (auto* a = std::get_if<AppendWork>(&entry)) Answer("prefill", [&] { a->done(status); });
  if (auto* c = std::get_if<ControlWork>(&entry)) Answer("fork/release", [&] { c->done(status); });
}

}  // namespace

Batcher::Batcher(const BatcherOptions& options, Executor* executor,
                 std::vector<std::unique_ptr<StagingBuffer>> staging)
    : options_(options), executor_(executor), staging_(std::move(staging)) {
  for (int i = 0; i < static_cast<int>(staging_.size()); ++i) free_buffers_.push_back(i);
  rows_.resize(staging_.size());
  for (std::vector<const DecodeItem*>& rows : rows_) rows.reserve(options_.max_batch_size);
  if (options_.staging_threads > 1)
    fill_pool_ = std::make_unique<CpuThreadPool>(options_.staging_threads);
}

void Batcher::FillStaging(const Ready& ready) {
  // Below this many rows (~22 KB each at the seed shape) waking the pool costs about
  // what it saves.
  constexpr size_t kPoolFillRows = 16;
  StagingBuffer& staging = *staging_[ready.buffer];
  std::vector<const DecodeItem*>& rows = rows_[ready.buffer];  // row r: the r-th item
  rows.clear();  // reserved for max_batch_size at construction: no allocation
  for (const DecodeWork& unit : ready.decodes)
    rows.insert(rows.end(), unit.items.begin(), unit.items.end());
  staging.PlanIndices(static_cast<int32_t>(rows.size()),
                      [&](int32_t row) -> const DecodeTensorBytes& { return rows[row]->bytes; });
  std::unique_lock<std::mutex> pool(fill_pool_mu_, std::defer_lock);
  if (fill_pool_ != nullptr && rows.size() >= kPoolFillRows && pool.try_lock()) {
    fill_pool_->ParallelFor(static_cast<int64_t>(rows.size()),
                            [&](int64_t i) { staging.FillRow(static_cast<int32_t>(i), *rows[i]); });
    return;
  }
  for (size_t i = 0; i < rows.size(); ++i) staging.FillRow(static_cast<int32_t>(i), *rows[i]);
}

Batcher::~Batcher() { Stop(); }

void Batcher::Start() {
  started_ = true;
  assembler_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "sds-assembler");  // for top -H, perf, gdb
    AssemblerLoop();
  });
  for (int i = 0; i < std::max(1, options_.max_concurrent_batches); ++i) {
    executor_threads_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "sds-executor");
      ExecutorLoop();
    });
  }
}

bool Batcher::CanStartLocked(const Ready& ready) const {
  if (ready.buffer < 0) return running_ == 0;
  return !running_alone_ && running_ < std::max(1, options_.max_concurrent_batches);
}

void Batcher::MarkRunningLocked(const Ready& ready) {
  ++running_;
  running_alone_ = ready.buffer < 0;
}

void Batcher::AddInFlightSequencesLocked(const std::vector<DecodeWork>& decodes, size_t first) {
  if (options_.max_concurrent_batches <= 1) return;
  for (size_t i = first; i < decodes.size(); ++i)
    for (const DecodeItem* item : decodes[i].items) ++in_flight_sequences_[absl::HashOf(item->key)];
}

void Batcher::RemoveInFlightSequencesLocked(const std::vector<DecodeWork>& decodes) {
  if (options_.max_concurrent_batches <= 1) return;
  for (const DecodeWork& d : decodes) {
    for (const DecodeItem* item : d.items) {
      auto it = in_flight_sequences_.find(absl::HashOf(item->key));
      if (it != in_flight_sequences_.end() && --it->second == 0) in_flight_sequences_.erase(it);
    }
  }
}

absl::Status Batcher::PushLocked(Entry& entry, bool counts_toward_depth, bool urgent, bool* wake) {
  if (stopping_) return absl::UnavailableError("server is draining");
  // A decode unit weighs its items, a prefill one.
  const auto* decode = std::get_if<DecodeWork>(&entry);
  const int64_t weight = decode != nullptr ? decode->size() : 1;
  if (decode != nullptr && (decode->sink == nullptr || decode->items.empty() ||
                            decode->size() > options_.max_batch_size)) {
    return absl::InternalError(absl::StrCat("internal error: a decode unit of ", decode->size(),
                                            " items (1 to ", options_.max_batch_size, " allowed)",
                                            decode->sink == nullptr ? " without a sink" : ""));
  }
  if (counts_toward_depth && limited_in_queue_ + weight > options_.max_queue_depth) {
    return absl::ResourceExhaustedError(absl::StrCat("decode queue full: ", limited_in_queue_,
                                                     " requests waiting; retry with backoff"));
  }
  // The assembler sleeps without a deadline only on an empty queue; otherwise it wakes
  // by itself when the oldest request's delay ends. Wake it only when this entry can
  // close a batch earlier: a context switch per request is the largest cost otherwise.
  // With concurrent batches the queued requests may all be held back (their sequences
  // in flight), so that this one could close a batch at once.
  const bool wake_now = decode == nullptr || (options_.eager && decode->closes_batch) ||
                        queue_.empty() || limited_in_queue_ + weight >= options_.max_batch_size ||
                        !in_flight_sequences_.empty();
  // The push first: when it throws (bad_alloc) nothing below has changed, and the
  // caller still owns the work.
  if (urgent) {
    queue_.insert(queue_.begin() + static_cast<std::ptrdiff_t>(urgent_in_front_), std::move(entry));
    ++urgent_in_front_;
  } else {
    queue_.push_back(std::move(entry));
  }
  *wake = *wake || wake_now;
  if (counts_toward_depth) limited_in_queue_ += weight;
  queue_events_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status Batcher::Enqueue(Entry entry, bool counts_toward_depth, bool urgent,
                              SubmitterRun* claim) {
  // Counted before it is visible to the assembler: an item that ran and completed before
  // being counted would let Drain miss its last wake-up.
  AddOutstanding(1);
  bool wake = false;
  absl::Status status;
  bool claimed = false;
  try {
    std::lock_guard<std::mutex> lock(queue_mu_);
    status = PushLocked(entry, counts_toward_depth, urgent, &wake);
    claimed = claim != nullptr && status.ok() && TryClaimLocked(claim);
  } catch (...) {  // bad_alloc from the push: nothing was queued
    Completed(1);
    throw;
  }
  if (!status.ok()) {
    Completed(1);
    return status;
  }
  // A claim may leave work queued (a second decode of a (sequence, layer), more than a
  // batch): the assembler must see it, as it would have without the claim.
  if (claimed ? QueueNonEmpty() : wake) queue_cv_.notify_one();
  return absl::OkStatus();
}

bool Batcher::QueueNonEmpty() const {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return !queue_.empty();
}

bool Batcher::TryClaimLocked(SubmitterRun* claim) {
  // The entry is queued: from here nothing may throw, or the caller would answer a
  // request that the batcher answers as well. A claim that fails to allocate changed
  // nothing (TakeBatchLocked allocates before it moves entries); the work stays queued
  // for the assembler.
  try {
    return ClaimForSubmitterLocked(claim);
  } catch (const std::exception& e) {
    spdlog::error(
        "batcher: claiming a batch for the submitting thread failed ({}); it "
        "stays queued for the assembler",
        e.what());
    return false;
  }
}

void Batcher::AddOutstanding(int64_t items) {
  std::lock_guard<std::mutex> lock(outstanding_mu_);
  outstanding_ += items;
}

std::vector<absl::Status> Batcher::SubmitDecodes(std::vector<DecodeWork>* works) {
  // Allocated before anything is queued: an item that cannot be pushed is refused with
  // `no_memory` (built by the first call only; its copies do not allocate) instead of
  // throwing while earlier items are already queued.
  std::vector<absl::Status> status(works->size());
  const absl::Status& no_memory = QueueOutOfMemory();
  bool wake = false;
  SubmitterRun claim;  // runs (if claimed) before this returns
  bool claimed = false;
  int64_t queued = 0;
  bool queued_heads = false;  // a split unit's first items were queued
  const Clock::time_point now = Clock::now();
  AddOutstanding(static_cast<int64_t>(works->size()));  // before visible, as in Enqueue
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    for (size_t i = 0; i < works->size(); ++i) {
      (*works)[i].enqueued = now;
      // A unit larger than the room left in the queue: its first items take the room, the
      // rest are refused (left in (*works)[i]), so that each item fails or runs alone.
      const int64_t room = options_.max_queue_depth - limited_in_queue_;
      if (!stopping_ && room > 0 && room < (*works)[i].size()) {
        DecodeWork head;
        try {
          head = (*works)[i];
          head.items.resize(static_cast<size_t>(room));
          head.closes_batch = true;
          Entry queued_head(std::move(head));
          if (PushLocked(queued_head, true, false, &wake).ok()) {
            // One more entry, counted while queue_mu_ still hides it from the assembler.
            AddOutstanding(1);
            auto& items = (*works)[i].items;
            items.erase(items.begin(), items.begin() + room);
            queued_heads = true;
          }
        } catch (const std::exception&) {
          // Not split: the whole unit goes through PushLocked below.
        }
      }
      Entry entry(std::move((*works)[i]));
      try {
        status[i] = PushLocked(entry, true, false, &wake);
      } catch (const std::exception&) {
        status[i] = no_memory;
      }
      if (status[i].ok()) {
        ++queued;
      } else {
        (*works)[i] = std::get<DecodeWork>(std::move(entry));  // refused: hand it back
      }
    }
    claimed = (queued > 0 || queued_heads) && TryClaimLocked(&claim);
  }
  Completed(static_cast<int64_t>(works->size()) - queued);  // the refused ones
  if (claimed ? QueueNonEmpty() : wake) queue_cv_.notify_one();
  // The queued items belong to the batcher now: an exception here must not reach the
  // caller, which would answer the call while its items are still being answered.
  try {
    claim.Run();
  } catch (const std::exception& e) {
    spdlog::critical("batcher: exception while running a claimed batch: {}", e.what());
  }
  return status;
}

absl::Status Batcher::SubmitDecode(DecodeWork work, SubmitterRun* claim) {
  work.enqueued = Clock::now();
  return Enqueue(std::move(work), true, false, claim);
}

absl::Status Batcher::SubmitAppend(AppendWork work) {
  work.enqueued = Clock::now();
  return Enqueue(std::move(work), true, false, nullptr);
}

absl::Status Batcher::SubmitControl(ControlWork work, bool urgent) {
  return Enqueue(std::move(work), false, urgent, nullptr);
}

int64_t Batcher::queue_depth() const {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return static_cast<int64_t>(queue_.size());
}

void Batcher::Completed(int64_t items) {
  if (items == 0) return;
  bool idle;
  {
    std::lock_guard<std::mutex> lock(outstanding_mu_);
    outstanding_ -= items;
    idle = outstanding_ == 0;
  }
  if (idle) outstanding_cv_.notify_all();
}

bool Batcher::TakeBatchLocked(Clock::time_point now, std::vector<DecodeWork>* decodes,
                              std::vector<DecodeWork>* expired, Clock::time_point* wait_until) {
  // Bound the scan so that a long run of same-(sequence, layer) requests cannot make
  // the critical section long.
  const size_t scan_limit = static_cast<size_t>(options_.max_batch_size) * 8;
  std::vector<ScanAction>& actions = scan_actions_;
  absl::flat_hash_set<std::pair<absl::string_view, int32_t>>& seen = scan_seen_;
  actions.clear();
  seen.clear();
  size_t eligible = 0, expiring = 0;
  bool blocked = false;  // a non-decode entry ends the scan: it keeps its place
  bool closes = false;   // the last item of a DecodeBatch call is in the batch
  Clock::time_point oldest = Clock::time_point::max();
  const size_t window = std::min(queue_.size(), scan_limit);
  bool full = false;  // the next unit would not fit
  for (size_t i = 0; i < window && eligible < static_cast<size_t>(options_.max_batch_size); ++i) {
    const DecodeWork* d = std::get_if<DecodeWork>(&queue_[i]);
    if (d == nullptr) {
      blocked = true;
      break;
    }
    if (now > d->deadline) {
      actions.push_back(ScanAction::kExpire);
      expiring += d->items.size();
      continue;
    }
    // Kept for a later batch: a unit holding a (sequence, layer) that this batch holds or
    // an earlier kept unit holds (its order with that unit stays), or a sequence that a
    // batch in flight holds. A kept unit's pairs block later units too.
    bool keep = false;
    for (const DecodeItem* item : d->items) {
      keep =
          keep || seen.contains({item->key, item->layer}) ||
          (!in_flight_sequences_.empty() && in_flight_sequences_.contains(absl::HashOf(item->key)));
    }
    if (!keep && eligible + d->items.size() > static_cast<size_t>(options_.max_batch_size)) {
      full = true;  // taken whole or not at all: the batch closes without it
      break;
    }
    for (const DecodeItem* item : d->items) seen.emplace(item->key, item->layer);
    if (keep) {
      actions.push_back(ScanAction::kKeep);
      continue;
    }
    actions.push_back(ScanAction::kTake);
    eligible += d->items.size();
    oldest = std::min(oldest, d->enqueued);
    closes = closes || d->closes_batch;
  }
  // Nothing to take (every scanned request's sequence is in a batch in flight): wait for
  // that batch, whatever else holds (a non-decode entry behind keeps its place).
  const bool anything = eligible > 0 || expiring > 0;
  const bool close =
      anything &&
      (eligible >= static_cast<size_t>(options_.max_batch_size) || full || blocked || draining_ ||
       stopping_ || actions.size() >= scan_limit ||
       (eligible > 0 && now - oldest >= options_.max_queue_delay) ||
       (eligible > 0 && options_.eager &&
        (closes || batches_in_flight_.load() < std::max(1, options_.max_concurrent_batches))) ||
       (eligible == 0 && expiring > 0));
  if (!close) {
    // Nothing eligible (every request's sequence is in flight): a batch's release wakes
    // the assembler; a bound (at least 1 ms, so that a zero queue delay does not turn
    // this wait into a busy loop) guards the wait anyway.
    *wait_until = eligible > 0 ? oldest + options_.max_queue_delay
                               : now + std::max<std::chrono::microseconds>(
                                           options_.max_queue_delay, std::chrono::milliseconds(1));
    return false;
  }
  // Allocate first: once entries leave the queue nothing may throw, or they would be lost.
  const size_t first_taken = decodes->size();
  size_t taking = 0, expiring_units = 0;
  for (ScanAction action : actions) {
    taking += action == ScanAction::kTake ? 1 : 0;
    expiring_units += action == ScanAction::kExpire ? 1 : 0;
  }
  decodes->reserve(decodes->size() + taking);
  expired->reserve(expired->size() + expiring_units);
  if (options_.max_concurrent_batches > 1)
    in_flight_sequences_.reserve(in_flight_sequences_.size() + eligible);
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i] == ScanAction::kTake) {
      decodes->push_back(std::get<DecodeWork>(std::move(queue_[i])));
    } else if (actions[i] == ScanAction::kExpire) {
      expired->push_back(std::get<DecodeWork>(std::move(queue_[i])));
    }
  }
  // Kept entries close up, in order, at the end of the scanned range; the rest goes.
  size_t to = actions.size();
  for (size_t i = actions.size(); i-- > 0;) {
    if (actions[i] != ScanAction::kKeep) continue;
    if (--to != i) queue_[to] = std::move(queue_[i]);
  }
  queue_.erase(queue_.begin(), queue_.begin() + static_cast<std::ptrdiff_t>(to));
  limited_in_queue_ -= static_cast<int64_t>(eligible + expiring);
  AddInFlightSequencesLocked(*decodes, first_taken);
  return true;
}

bool Batcher::TakeWork(std::vector<DecodeWork>* decodes, std::unique_ptr<Entry>* single,
                       std::vector<DecodeWork>* expired) {
  std::unique_lock<std::mutex> lock(queue_mu_);
  Clock::time_point spin_until{};  // set by the first spin of this call
  while (true) {
    if (queue_.empty()) {
      if (stopping_) return false;
      SpinThenWait(lock, queue_cv_, queue_events_, options_.idle_spin,
                   [&] { return !queue_.empty() || stopping_; });
      continue;
    }
    if (!std::holds_alternative<DecodeWork>(queue_.front())) {
      if (std::holds_alternative<AppendWork>(queue_.front())) --limited_in_queue_;
      if (urgent_in_front_ > 0) --urgent_in_front_;
      *single = std::make_unique<Entry>(std::move(queue_.front()));
      queue_.pop_front();
      assembler_holding_ = true;
      return true;
    }
    Clock::time_point wait_until;
    const Clock::time_point now = Clock::now();
    if (TakeBatchLocked(now, decodes, expired, &wait_until)) {
      assembler_holding_ = true;
      return true;
    }
    // Eager and a batch in flight: the batch closes when that one is done (or a request
    // arrives that closes it). With idle_spin, poll for either instead of sleeping: the
    // next batch would otherwise start a futex wake-up after the last one ended, on the
    // path of every batch under load. TakeBatchLocked checks again under the lock after
    // the spin, so a notification missed while spinning is not lost.
    const int in_flight = batches_in_flight_.load();
    if (options_.eager && options_.idle_spin.count() > 0 && in_flight > 0) {
      if (spin_until == Clock::time_point{}) spin_until = now + options_.idle_spin;
      if (now < spin_until) {
        const uint64_t seen = queue_events_.load(std::memory_order_relaxed);
        lock.unlock();
        SpinUntil(std::min(spin_until, wait_until), [&] {
          return batches_in_flight_.load(std::memory_order_relaxed) != in_flight ||
                 queue_events_.load(std::memory_order_relaxed) != seen;
        });
        lock.lock();
        continue;
      }
    }
    queue_cv_.wait_until(lock, wait_until);
  }
}

bool Batcher::ClaimForSubmitterLocked(SubmitterRun* claim) {
  if (!options_.run_on_submitter || !options_.eager || stopping_ || claim->batcher_ != nullptr ||
      queue_.empty() || !std::holds_alternative<DecodeWork>(queue_.front())) {
    return false;
  }
  std::lock_guard<std::mutex> lock(pipe_mu_);
  // Idle: no unit runs or waits for the executor thread, and the assembler holds none
  // (one it took earlier would otherwise run after this later one).
  if (running_ > 0 || assembler_holding_ || !ready_.empty() || free_buffers_.empty()) {
    return false;
  }
  Clock::time_point wait_until;
  Ready& ready = claim->ready_;
  if (!TakeBatchLocked(Clock::now(), &ready.decodes, &claim->expired_, &wait_until)) return false;
  claim->batcher_ = this;  // at least the expired requests are to be answered
  ++claims_in_flight_;
  if (ready.decodes.empty()) return false;
  ready.buffer = free_buffers_.back();
  free_buffers_.pop_back();
  MarkRunningLocked(ready);
  pipe_events_.fetch_add(1, std::memory_order_relaxed);  // a spinning executor sleeps instead
  batches_in_flight_.fetch_add(1);
  return true;
}

void Batcher::RunClaimed(SubmitterRun* claim) {
  // ClaimDone on every way out, exceptions included: Stop waits for it.
  struct Done {
    Batcher* batcher;
    ~Done() { batcher->ClaimDone(); }
  } done{this};
  RunClaimedUnit(claim);
}

void Batcher::ClaimDone() {
  // Notified under the lock: Stop may destroy the batcher once it has the lock back.
  std::lock_guard<std::mutex> lock(pipe_mu_);
  --claims_in_flight_;
  buffer_cv_.notify_all();
}

void Batcher::RunClaimedUnit(SubmitterRun* claim) {
  AnswerAll(claim->expired_, Expired());
  Completed(static_cast<int64_t>(claim->expired_.size()));
  claim->expired_.clear();
  Ready& ready = claim->ready_;
  if (ready.buffer < 0) return;
  bool filled = false;
  try {
    FillStaging(ready);
    filled = true;
  } catch (const std::exception& e) {
    spdlog::critical("batcher: exception while staging a claimed batch of {}: {}",
                     ready.decodes.size(), e.what());
  }
  if (filled) {
    RunReady(ready);  // catches, then releases the unit
    return;
  }
  // Not run: answer its requests, then release the unit (running_, the staging
  // buffer) as RunReady would, so that the batcher does not wedge.
  // The resources first, as RunReady: the completions may free the items the in-flight
  // sequences are read from.
  ReleaseResources(ready);
  AnswerAll(ready.decodes, absl::InternalError("internal error while staging the batch; "
                                               "it was not run"));
  FinishUnit(static_cast<int64_t>(ready.decodes.size()));
}

void Batcher::SubmitterRun::Run() {
  Batcher* batcher = std::exchange(batcher_, nullptr);
  if (batcher != nullptr) batcher->RunClaimed(this);
  ready_ = Ready();  // fresh: a SubmitterRun may claim again after it ran
  expired_.clear();
}

void Batcher::AssemblerLoop() {
  while (true) {
    int buffer;
    {
      std::unique_lock<std::mutex> lock(pipe_mu_);
      buffer_cv_.wait(lock, [&] { return !free_buffers_.empty(); });
      buffer = free_buffers_.back();
      free_buffers_.pop_back();
    }
    std::vector<DecodeWork> decodes, expired;
    std::unique_ptr<Entry> single;
    const bool more = TakeWork(&decodes, &single, &expired);
    AnswerAll(expired, Expired());
    Completed(static_cast<int64_t>(expired.size()));

    Ready ready;
    if (!decodes.empty()) {
      // The copy of the items' tensors into staging runs while the executor computes.
      ready.buffer = buffer;
      ready.decodes = std::move(decodes);
      FillStaging(ready);
      batches_in_flight_.fetch_add(1);
    } else {
      ready.single = std::move(single);
    }
    const bool has_work = ready.buffer >= 0 || ready.single != nullptr;
    // Work already waiting means load: hand the unit over so that the next batch is
    // assembled while this one runs.
    bool queue_empty = false;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queue_empty = queue_.empty();
    }
    bool run_here = false;
    {
      std::lock_guard<std::mutex> lock(pipe_mu_);
      if (ready.buffer < 0) free_buffers_.push_back(buffer);
      assembler_holding_ = false;
      // Nothing waiting and an idle executor thread: there is nothing to overlap, so run
      // the unit here instead of paying a wake-up and a context switch for the
      // hand-over. Only this thread fills ready_, so the executor thread stays idle
      // until this unit is done, and units still run one at a time in queue order.
      // A prefill (AppendWork) may be long: it always goes to the executor thread, so
      // that decodes arriving meanwhile are still assembled.
      const bool prefill =
          ready.single != nullptr && std::holds_alternative<AppendWork>(*ready.single);
      // With concurrent batches and spinning executor threads a hand-over costs no wake-up,
      // and this thread stays free to assemble the batch that runs beside this one.
      const bool keep_free = options_.max_concurrent_batches > 1 && options_.idle_spin.count() > 0;
      run_here =
          has_work && !prefill && !keep_free && queue_empty && ready_.empty() && running_ == 0;
      if (run_here) MarkRunningLocked(ready);
      if (has_work && !run_here) ready_.push_back(std::move(ready));
      if (!more) assembler_done_ = true;
      // Ends an executor's spin: on a hand-over it runs the unit, on a unit run here it
      // sleeps instead of spinning beside it.
      if (has_work || !more) pipe_events_.fetch_add(1, std::memory_order_relaxed);
    }
    if (run_here) {
      RunReady(ready);
    } else if (!more) {
      ready_cv_.notify_all();  // every executor thread exits once ready_ is empty
    } else if (has_work) {
      ready_cv_.notify_one();
    }
    if (!more) return;
  }
}

void Batcher::ExecutorLoop() {
  while (true) {
    Ready ready;
    {
      std::unique_lock<std::mutex> lock(pipe_mu_);
      SpinThenWait(lock, ready_cv_, pipe_events_, options_.idle_spin, [&] {
        return (!ready_.empty() && CanStartLocked(ready_.front())) ||
               (ready_.empty() && assembler_done_);
      });
      if (ready_.empty()) return;
      ready = std::move(ready_.front());
      ready_.pop_front();
      MarkRunningLocked(ready);
    }
    RunReady(ready);
  }
}

void Batcher::RunReady(Ready& ready) {
  // Every unit is answered exactly once, exceptions (bad_alloc) included: an unanswered
  // call would hang its client until its deadline. The work runs inside a try, the
  // answer after it.
  int64_t items = 0;
  if (ready.buffer >= 0) {
    items = static_cast<int64_t>(ready.decodes.size());
    // The batch's staging buffer and the executor go to the next batch before its
    // answers are completed: on the H200 host at 16 streams the completions (posts to
    // the answer threads) held the next batch back.
    bool released = false;
    try {
      executor_->RunDecodeBatch(*staging_[ready.buffer], ready.decodes, [&] {
        released = true;  // first: were it to throw, a second release would double-free
        ReleaseResources(ready);
      });  // answers them
    } catch (const std::exception& e) {
      spdlog::critical("executor: exception escaped a decode batch's answers: {}", e.what());
    }
    if (!released) ReleaseResources(ready);
    FinishUnit(items);
    return;
  } else if (auto* append = std::get_if<AppendWork>(ready.single.get())) {
    items = 1;
    absl::StatusOr<int64_t> length;
    try {
      length = executor_->RunAppend(*append);
    } catch (const std::exception& e) {
      spdlog::critical("executor: exception while running a prefill of '{}': {}", append->key,
                       e.what());
      length = absl::InternalError(absl::StrCat("internal error in the prefill: ", e.what()));
    }
    Answer("prefill", [&] { append->done(std::move(length)); });
  } else if (auto* control = std::get_if<ControlWork>(ready.single.get())) {
    items = 1;
    absl::Status status;
    try {
      status = CheckStillWanted(Clock::now(), control->deadline, control->cancelled);
      if (status.ok()) status = control->run();
    } catch (const std::exception& e) {
      spdlog::critical("executor: exception while running a fork/release: {}", e.what());
      status = absl::InternalError(absl::StrCat("internal error in the fork/release: ", e.what()));
    }
    Answer("fork/release", [&] { control->done(status); });
  }
  ReleaseUnit(ready, items);
}

void Batcher::ReleaseUnit(Ready& ready, int64_t items) {
  ReleaseResources(ready);
  FinishUnit(items);
}

void Batcher::FinishUnit(int64_t items) {
  Completed(items);
  if (options_.after_unit_release_for_test) options_.after_unit_release_for_test();
}

void Batcher::ReleaseResources(const Ready& ready) {
  bool queued_units = false;
  {
    std::lock_guard<std::mutex> lock(pipe_mu_);
    --running_;
    running_alone_ = false;
    if (ready.buffer >= 0) free_buffers_.push_back(ready.buffer);
    queued_units = !ready_.empty();
    pipe_events_.fetch_add(1, std::memory_order_relaxed);
  }
  // A unit handed over while this one ran on a submitting thread, or one that waited for
  // the units running beside this one, waits for this moment.
  const int max_batches = std::max(1, options_.max_concurrent_batches);
  if (queued_units && (options_.run_on_submitter || max_batches > 1)) ready_cv_.notify_all();
  if (ready.buffer >= 0) {
    buffer_cv_.notify_one();
    // An eager assembler holding requests waits for this moment, and with concurrent
    // batches requests of this batch's sequences may be queued. Checked under the lock,
    // so that no wake-up is lost (see TakeWork); an empty queue needs none: the next
    // submit wakes the assembler itself when it can close a batch. The sequences leave
    // the in-flight set before the count drops: a spinning assembler polls the count
    // (TakeWork) and must then find them free, or their next requests would wait a batch.
    bool queued = false;
    if (max_batches > 1 || options_.eager) {
      std::lock_guard<std::mutex> lock(queue_mu_);
      RemoveInFlightSequencesLocked(ready.decodes);
      const int before = batches_in_flight_.fetch_sub(1);
      queued = (max_batches > 1 || before == 1) && !queue_.empty();
    } else {
      batches_in_flight_.fetch_sub(1);
    }
    if (queued) queue_cv_.notify_one();
  }
}

bool Batcher::Drain(Clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    draining_ = true;
    queue_events_.fetch_add(1, std::memory_order_relaxed);  // ends a spinning assembler's poll
  }
  queue_cv_.notify_all();
  std::unique_lock<std::mutex> lock(outstanding_mu_);
  return outstanding_cv_.wait_until(lock, deadline, [&] { return outstanding_ == 0; });
}

void Batcher::Stop() {
  std::deque<Entry> leftover;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (stopping_) return;
    stopping_ = true;
    queue_events_.fetch_add(1, std::memory_order_relaxed);
    leftover.swap(queue_);
    limited_in_queue_ = 0;
    urgent_in_front_ = 0;
  }
  queue_cv_.notify_all();
  for (Entry& entry : leftover) FailEntry(entry, Stopped());  // does not throw
  Completed(static_cast<int64_t>(leftover.size()));
  if (started_) {
    assembler_.join();
    for (std::thread& t : executor_threads_) t.join();
  }
  // A unit running on a submitting thread still uses the executor and a staging buffer,
  // and its thread the batcher until its run is done (ClaimDone).
  std::unique_lock<std::mutex> lock(pipe_mu_);
  buffer_cv_.wait(lock, [&] { return running_ == 0 && claims_in_flight_ == 0; });
}

}  // namespace sds::server
