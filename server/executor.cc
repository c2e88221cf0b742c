#include "server/executor.h"

#include <algorithm>
#include <cstring>
#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/caller_status.h"
#include "spdlog/spdlog.h"

namespace sds::server {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
int64_t Micros(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::microseconds>(d).count();
}

// The cache's slots of a batch's or prefill's new tokens: scratch per thread (batches
// may run on several executor threads at once), kept for its capacity: no allocation
// per unit.
std::vector<int64_t>& SlotScratch() {
  thread_local std::vector<int64_t> slots;
  return slots;
}

// The answer for a row that the backend found invalid on the device (row_error).
absl::Status DeviceRowError(uint8_t error) {
  if (error == kRowNonFinite) {
    return absl::InvalidArgumentError(
        "q, gate, k or v holds NaN or Inf (checked on the device); inputs must be finite "
        "(nothing was stored)");
  }
  return absl::InvalidArgumentError(
      "indices: an index is outside [-1, position] (checked on the device); each index must "
      "be -1 (skip) or a token position up to the request's (nothing was stored)");
}

// Calls AfterRun of the units whose BeforeRun succeeded, however RunBatch ends.
struct AfterRuns {
  std::vector<DecodeWork>& units;
  std::vector<char> pinned;
  ~AfterRuns() {
    for (size_t u = 0; u < pinned.size(); ++u)
      if (pinned[u]) units[u].sink->AfterRun();
  }
};

}  // namespace

Executor::Executor(Backend* backend, Metrics* metrics, const ModelShape& model)
    : backend_(backend),
      metrics_(metrics),
      model_(model),
      page_size_(backend->cache().config().page_size) {}

absl::Status Executor::BackendFailure(const absl::Status& run_status, absl::string_view what) {
  if (run_status.code() == absl::StatusCode::kResourceExhausted) {
    // Out of device or staging memory: the caller may retry (later, or smaller).
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", run_status.message()));
  }
  if (!IsBackendLost(run_status)) {
    return absl::InternalError(absl::StrCat(what, ": ", run_status.message()));
  }
  if (!backend_lost_.exchange(true)) {
    spdlog::critical("the {} backend is lost: {}; nothing can run until the process restarts",
                     backend_->name(), run_status.ToString());
    if (on_backend_lost_) on_backend_lost_(run_status);
  }
  return absl::UnavailableError(
      absl::StrCat("the server's ", backend_->name(),
                   " backend failed and the server is stopping (retry on another replica): ",
                   run_status.message()));
}

absl::StatusOr<std::unique_ptr<Executor>> Executor::Create(Backend* backend, Metrics* metrics,
                                                           const ModelShape& model) {
  std::unique_ptr<Executor> ex(new Executor(backend, metrics, model));
  const int64_t row = static_cast<int64_t>(model.num_kv_heads) * model.head_dim;
  const size_t kv_bytes = kAppendChunk * row * sizeof(uint16_t);
  const size_t bytes = 2 * kv_bytes + kAppendChunk * (sizeof(int32_t) + sizeof(int64_t));
  ex->append_block_ = backend->AllocateStaging(bytes);
  if (ex->append_block_ == nullptr) {
    return absl::ResourceExhaustedError("cannot allocate the prefill staging buffer");
  }
  char* base = static_cast<char*>(ex->append_block_);
  ex->append_k_ = reinterpret_cast<uint16_t*>(base);
  ex->append_v_ = reinterpret_cast<uint16_t*>(base + kv_bytes);
  ex->append_slot_ = reinterpret_cast<int64_t*>(base + 2 * kv_bytes);
  ex->append_layer_ = reinterpret_cast<int32_t*>(base + 2 * kv_bytes + kAppendChunk * 8);
  return ex;
}

Executor::~Executor() {
  if (append_block_) backend_->FreeStaging(append_block_);
}

void Executor::RunDecodeBatch(StagingBuffer& staging, std::vector<DecodeWork>& units,
                              const std::function<void()>& before_answers) {
  std::vector<absl::Status> status;  // per row: the units' items in order
  size_t finished = 0;
  absl::Status failed;
  try {
    size_t rows = 0;
    for (const DecodeWork& unit : units) rows += unit.items.size();
    status.resize(rows);
    RunBatch(staging, units, status, &finished);
  } catch (const std::exception& e) {
    // Only bad_alloc can get here. Every item is still answered, once: a request left
    // unanswered would hang its caller until its deadline. Those that RunBatch had
    // finished get their own outcome (their tokens are in the cache); the rest INTERNAL,
    // the one whose answer was being written included, though its token may be written
    // (a retry with the same data rewrites it harmlessly).
    spdlog::critical("decode batch of {} units: exception while running it after {} answers: {}",
                     units.size(), finished, e.what());
    failed =
        absl::InternalError(absl::StrCat("internal error while running the batch: ", e.what()));
  }
  // The answers are written (DecodeSink::Write copies out of staging); the completions
  // below use only `units`, `status` and `failed`.
  if (before_answers) before_answers();
  size_t row = 0;
  for (DecodeWork& unit : units) {
    const size_t first = row;
    row += unit.items.size();
    try {
      if (status.size() < row) {  // the status array itself could not be allocated
        Complete(unit, {&failed, 1});
        continue;
      }
      for (size_t r = first; r < row; ++r) {
        const DecodeItem& item = *unit.items[r - first];
        if (!failed.ok() && r >= finished) {
          status[r] = failed;
        } else if (!status[r].ok()) {
          status[r] = ForCaller(status[r], item.key, item.sequence_id);
        }
      }
      Complete(unit, absl::Span<const absl::Status>(status).subspan(first, unit.items.size()));
    } catch (const std::exception& e) {
      // Not its items' keys: a completion may have freed them before it threw.
      spdlog::critical("decode batch: exception from the completion of a unit of {}: {}",
                       unit.items.size(), e.what());
    }
  }
}

void Executor::RunBatch(StagingBuffer& staging, std::vector<DecodeWork>& units,
                        std::vector<absl::Status>& status, size_t* finished) {
  const Clock::time_point start = Clock::now();
  PagedKvCache& cache = backend_->cache();
  const int32_t n = static_cast<int32_t>(status.size());  // rows: the units' items in order
  std::vector<int32_t> row_of(n, -1);                     // staging row after compaction
  std::vector<int64_t>& slots = SlotScratch();
  thread_local std::vector<int32_t> pages;            // scratch per thread too (see SlotScratch)
  thread_local std::vector<const DecodeItem*> items;  // row -> item
  thread_local std::vector<int32_t> unit_of;          // row -> unit
  items.clear();
  unit_of.clear();
  for (size_t u = 0; u < units.size(); ++u) {
    for (const DecodeItem* item : units[u].items) {
      items.push_back(item);
      unit_of.push_back(static_cast<int32_t>(u));
    }
  }

  AfterRuns after_runs{units, std::vector<char>(units.size(), 0)};

  // 1. Per unit: still wanted, and its sink's BeforeRun; then per item the slot for its
  // new token (may copy shared pages), dropping failed requests.
  int32_t rows = 0;
  int32_t row = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    DecodeWork& unit = units[u];
    absl::Status unit_status = CheckStillWanted(start, unit.deadline, unit.cancelled);
    if (unit_status.ok() && unit.sink == nullptr) {
      unit_status = absl::InternalError("decode unit without a sink");  // a caller's bug
    }
    if (unit_status.ok()) {
      unit_status = unit.sink->BeforeRun();
      after_runs.pinned[u] = unit_status.ok() ? 1 : 0;
    }
    for (const DecodeItem* item : unit.items) {
      const int32_t i = row++;
      if (!unit_status.ok()) {
        status[i] = unit_status;
        continue;
      }
      if (staging.fill_failed(i)) {  // checked before any row moves
        status[i] = absl::FailedPreconditionError(
            "the request's tensors could not be read: its shared-memory object was shrunk "
            "under its region (nothing was stored)");
        continue;
      }
      status[i] =
          cache.PrepareWrite(item->key, item->layer, item->position, 1, &slots, item->incarnation);
      if (!status[i].ok()) continue;
      if (rows != i) staging.MoveRow(rows, i);
      staging.slot()[rows] = slots[0];
      row_of[i] = rows++;
    }
  }

  // 2. Page tables, after every PrepareWrite of the batch (they may move pages).
  absl::Status batch_error;
  int64_t table_size = 0;
  for (int32_t i = 0; i < n && rows > 0; ++i) {
    if (row_of[i] < 0) continue;
    pages.clear();
    const DecodeItem& item = *items[i];
    absl::Status s = cache.AppendPageTable(item.key, &pages, item.incarnation);
    const int64_t needed = item.position / page_size_ + 1;
    if (s.ok() && static_cast<int64_t>(pages.size()) < needed) {
      s = absl::InternalError(absl::StrCat("page table has ", pages.size(), " pages, position ",
                                           item.position, " needs ", needed));
    }
    if (!s.ok()) {
      // Cannot happen after a successful PrepareWrite on this thread: a bug.
      spdlog::error("decode batch: page table of '{}' failed: {}", item.key, s.ToString());
      batch_error = absl::InternalError(absl::StrCat("page table lookup failed: ", s.message()));
      break;
    }
    if (s = staging.ReservePageTable(table_size + needed); !s.ok()) {
      // Out of (pinned) staging memory for the batch's page tables: RESOURCE_EXHAUSTED.
      spdlog::error("decode batch of {} requests: {}", rows, s.ToString());
      batch_error = s;
      break;
    }
    staging.page_table_offset()[row_of[i]] = table_size;
    std::memcpy(staging.page_table() + table_size, pages.data(), needed * sizeof(int32_t));
    table_size += needed;
  }

  // 3. Run.
  BatchTiming timing;
  absl::Status run_status = batch_error;
  if (rows > 0 && run_status.ok()) {
    BatchWork work;
    staging.Describe(rows, &work);
    // lse costs a log per query head: only when a request of the batch asked for it.
    bool any_lse = false;
    for (int32_t i = 0; i < n && !any_lse; ++i) any_lse = row_of[i] >= 0 && items[i]->return_lse;
    if (!any_lse) work.decode.lse = nullptr;
    run_status = backend_->Run(work, &timing);
    if (!run_status.ok()) {
      spdlog::error("decode batch of {} failed in the {} backend: {}", rows, backend_->name(),
                    run_status.ToString());
    }
  }
  const uint64_t batch_id = rows > 0 ? next_batch_id_.fetch_add(1) : 0;

  // 4. Answers, then commits; metrics; then complete (so that a caller who got its
  // answer already sees this batch in /metrics).
  Clock::duration oldest_wait{};
  BatchInfo info;
  info.batch_id = batch_id;
  info.batch_size = rows;
  info.compute_us = timing.compute_us;
  for (int32_t i = 0; i < n; ++i) {
    if (row_of[i] >= 0) {
      const DecodeItem& item = *items[i];
      DecodeWork& unit = units[unit_of[i]];
      if (!batch_error.ok()) {
        status[i] = batch_error;  // the batch did not reach the backend
      } else if (!run_status.ok()) {
        status[i] = BackendFailure(run_status, "backend failed to run the batch");
      } else if (staging.row_error(row_of[i]) != kRowOk) {
        status[i] = DeviceRowError(staging.row_error(row_of[i]));  // nothing was stored
      } else {
        // Written before the commit: an answer that cannot be delivered (its region was
        // unregistered) leaves the token uncommitted, as if never sent.
        info.queue_us = Micros(start - unit.enqueued);
        status[i] = unit.sink->Write(item.index, info, staging.out_row(row_of[i]),
                                     item.return_lse ? staging.lse_row(row_of[i]) : nullptr);
        if (status[i].ok()) {
          status[i] = cache.CommitWrite(item.key, item.layer, item.position, 1, item.incarnation);
        }
        if (status[i].ok()) oldest_wait = std::max(oldest_wait, start - unit.enqueued);
      }
    }
    *finished = static_cast<size_t>(i) + 1;  // status[i] is final, its answer written
  }

  if (rows > 0) {
    const Clock::time_point end = Clock::now();
    if (run_status.ok()) metrics_->AddTokensAppended(rows);
    metrics_->ObserveBatch(rows, Seconds(oldest_wait), timing.compute_us * 1e-6,
                           Seconds(end - start));
    spdlog::debug("batch {}: size {} of {} queued, oldest wait {} us, compute {} us, total {} us",
                  batch_id, rows, n, Micros(oldest_wait), timing.compute_us, Micros(end - start));
  }
}

absl::StatusOr<int64_t> Executor::Append(const AppendWork& work) {
  // A cancelled prefill must not write: its caller may already be sending another.
  if (absl::Status s = CheckStillWanted(Clock::now(), work.deadline, work.cancelled); !s.ok()) {
    return s;
  }
  PagedKvCache& cache = backend_->cache();
  const int64_t n = work.num_tokens;
  std::vector<int64_t>& slots = SlotScratch();
  absl::Status s =
      cache.PrepareWrite(work.key, work.layer, work.start_position, n, &slots, work.incarnation);
  if (!s.ok()) return s;
  const int64_t row = static_cast<int64_t>(model_.num_kv_heads) * model_.head_dim;
  BatchTiming total;
  for (int64_t begin = 0; begin < n; begin += kAppendChunk) {
    const int64_t count = std::min(kAppendChunk, n - begin);
    std::memcpy(append_k_, work.k + begin * row * 2, count * row * 2);
    std::memcpy(append_v_, work.v + begin * row * 2, count * row * 2);
    std::fill_n(append_layer_, count, work.layer);
    std::memcpy(append_slot_, slots.data() + begin, count * sizeof(int64_t));
    BatchWork work_item;
    work_item.append.num_tokens = static_cast<int32_t>(count);
    work_item.append.k_new = append_k_;
    work_item.append.v_new = append_v_;
    work_item.append.layer = append_layer_;
    work_item.append.slot = append_slot_;
    BatchTiming timing;
    s = backend_->Run(work_item, &timing);
    if (!s.ok()) {
      spdlog::error("prefill of {} tokens failed in the {} backend: {}", count, backend_->name(),
                    s.ToString());
      return BackendFailure(s, "backend failed to append");
    }
    total.compute_us += timing.compute_us;
  }
  s = cache.CommitWrite(work.key, work.layer, work.start_position, n, work.incarnation);
  if (!s.ok()) return s;
  metrics_->AddTokensAppended(n);
  spdlog::debug("prefill: {} tokens of layer {} at {}, compute {} us", n, work.layer,
                work.start_position, total.compute_us);
  return cache.Length(work.key, work.layer);
}

absl::StatusOr<int64_t> Executor::RunAppend(const AppendWork& work) {
  absl::StatusOr<int64_t> length = Append(work);
  if (!length.ok()) {
    length = ForCaller(length.status(), work.key, work.sequence_id);
  }
  return length;
}

}  // namespace sds::server
