#include "server/executor.h"

#include <algorithm>
#include <cstring>
#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/rpc_util.h"
#include "spdlog/spdlog.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

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

// Calls after_run of the items whose before_run succeeded, however RunBatch ends.
struct AfterRuns {
  std::vector<DecodeWork>& items;
  std::vector<char> pinned;
  ~AfterRuns() {
    for (size_t i = 0; i < pinned.size(); ++i)
      if (pinned[i]) items[i].after_run();
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

void Executor::RunDecodeBatch(StagingBuffer& staging, std::vector<DecodeWork>& items,
                              const std::function<void()>& before_answers) {
  std::vector<absl::Status> status;
  size_t finished = 0;
  absl::Status failed;
  try {
    status.resize(items.size());
    RunBatch(staging, items, status, &finished);
  } catch (const std::exception& e) {
    // Only bad_alloc can get here. Every item is still answered, once: a request left
    // unanswered would hang its caller until its deadline. Those that RunBatch had
    // finished get their own outcome (their tokens are in the cache); the rest INTERNAL,
    // the one whose answer was being built included, though its token may be written
    // (a retry with the same data rewrites it harmlessly).
    spdlog::critical("decode batch of {}: exception while running it after {} answers: {}",
                     items.size(), finished, e.what());
    failed =
        absl::InternalError(absl::StrCat("internal error while running the batch: ", e.what()));
  }
  // The answers are encoded (EncodeAnswer copies out of staging); the completions below
  // use only `items`, `status` and `failed`.
  if (before_answers) before_answers();
  for (size_t i = 0; i < items.size(); ++i) {
    try {
      items[i].done(failed.ok() || i < finished
                        ? ForCaller(status[i], items[i].key, items[i].request->sequence_id())
                        : failed);
    } catch (const std::exception& e) {
      spdlog::critical("decode batch: exception from the completion of request {} of '{}': {}",
                       items[i].request->request_id(), items[i].key, e.what());
    }
  }
}

void Executor::RunBatch(StagingBuffer& staging, std::vector<DecodeWork>& items,
                        std::vector<absl::Status>& status, size_t* finished) {
  const Clock::time_point start = Clock::now();
  PagedKvCache& cache = backend_->cache();
  const int32_t n = static_cast<int32_t>(items.size());
  std::vector<int32_t> row_of(n, -1);  // staging row after compaction
  std::vector<int64_t>& slots = SlotScratch();
  thread_local std::vector<int32_t> pages;  // scratch per thread too (see SlotScratch)

  AfterRuns after_runs{items, std::vector<char>(n, 0)};

  // 1. Slots for the new tokens (may copy shared pages), dropping failed requests.
  int32_t rows = 0;
  for (int32_t i = 0; i < n; ++i) {
    const v1::DecodeRequest& req = *items[i].request;
    if (items[i].encoded == nullptr && !items[i].write_answer) {
      // A bug in the caller: nowhere to put the answer.
      status[i] = absl::InternalError("decode work item without an answer slot");
      continue;
    }
    if (staging.fill_failed(i)) {  // checked before any row moves
      status[i] = absl::FailedPreconditionError(
          "the request's tensors could not be read: its shared-memory object was shrunk under "
          "its region (nothing was stored)");
      continue;
    }
    status[i] = CheckStillWanted(start, items[i].deadline, items[i].cancelled);
    if (!status[i].ok()) continue;
    if (items[i].before_run) {
      status[i] = items[i].before_run();
      if (!status[i].ok()) continue;
      after_runs.pinned[i] = items[i].after_run ? 1 : 0;
    }
    status[i] = cache.PrepareWrite(items[i].key, req.layer(), req.position(), 1, &slots,
                                   items[i].incarnation);
    if (!status[i].ok()) continue;
    if (rows != i) staging.MoveRow(rows, i);
    staging.slot()[rows] = slots[0];
    row_of[i] = rows++;
  }

  // 2. Page tables, after every PrepareWrite of the batch (they may move pages).
  absl::Status batch_error;
  int64_t table_size = 0;
  for (int32_t i = 0; i < n && rows > 0; ++i) {
    if (row_of[i] < 0) continue;
    pages.clear();
    const v1::DecodeRequest& req = *items[i].request;
    absl::Status s = cache.AppendPageTable(items[i].key, &pages, items[i].incarnation);
    const int64_t needed = req.position() / page_size_ + 1;
    if (s.ok() && static_cast<int64_t>(pages.size()) < needed) {
      s = absl::InternalError(absl::StrCat("page table has ", pages.size(), " pages, position ",
                                           req.position(), " needs ", needed));
    }
    if (!s.ok()) {
      // Cannot happen after a successful PrepareWrite on this thread: a bug.
      spdlog::error("decode batch: page table of '{}' failed: {}", req.sequence_id(), s.ToString());
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
    for (int32_t i = 0; i < n && !any_lse; ++i) {
      any_lse = row_of[i] >= 0 && items[i].request->return_lse();
    }
    if (!any_lse) work.decode.lse = nullptr;
    run_status = backend_->Run(work, &timing);
    if (!run_status.ok()) {
      spdlog::error("decode batch of {} failed in the {} backend: {}", rows, backend_->name(),
                    run_status.ToString());
    }
  }
  const uint64_t batch_id = rows > 0 ? next_batch_id_.fetch_add(1) : 0;

  // 4. Commit and fill the responses; metrics; then complete (so that a caller who
  // got its answer already sees this batch in /metrics).
  Clock::duration oldest_wait{};
  for (int32_t i = 0; i < n; ++i) {
    DecodeWork& item = items[i];
    if (row_of[i] >= 0) {
      const v1::DecodeRequest& req = *item.request;
      if (!batch_error.ok()) {
        status[i] = batch_error;  // the batch did not reach the backend
      } else if (!run_status.ok()) {
        status[i] = BackendFailure(run_status, "backend failed to run the batch");
      } else if (staging.row_error(row_of[i]) != kRowOk) {
        status[i] = DeviceRowError(staging.row_error(row_of[i]));  // nothing was stored
      } else if (item.write_answer) {
        // Written before the commit: an answer that cannot be delivered (its region was
        // unregistered) leaves the token uncommitted, as if never sent.
        status[i] = item.write_answer(staging.out_row(row_of[i]),
                                      req.return_lse() ? staging.lse_row(row_of[i]) : nullptr);
        if (status[i].ok()) {
          status[i] = cache.CommitWrite(item.key, req.layer(), req.position(), 1, item.incarnation);
        }
      } else {
        status[i] = cache.CommitWrite(item.key, req.layer(), req.position(), 1, item.incarnation);
      }
      if (status[i].ok()) {
        v1::DecodeResponse* resp = item.response;
        resp->set_request_id(req.request_id());
        v1::BatchInfo* info = resp->mutable_batch();
        info->set_batch_id(batch_id);
        info->set_batch_size(rows);
        info->set_queue_us(Micros(start - item.enqueued));
        info->set_compute_us(timing.compute_us);
        if (!item.write_answer)
          staging.EncodeAnswer(row_of[i], req.return_lse(), *resp, item.encoded);
        oldest_wait = std::max(oldest_wait, start - item.enqueued);
      }
    }
    *finished = static_cast<size_t>(i) + 1;  // status[i] is final, its answer encoded
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
  const v1::AppendKVRequest& req = *work.request;
  // A cancelled prefill must not write: its caller may already be sending another.
  if (absl::Status s = CheckStillWanted(Clock::now(), work.deadline, work.cancelled); !s.ok()) {
    return s;
  }
  PagedKvCache& cache = backend_->cache();
  const int64_t n = req.k().shape(0);
  std::vector<int64_t>& slots = SlotScratch();
  absl::Status s =
      cache.PrepareWrite(work.key, req.layer(), req.start_position(), n, &slots, work.incarnation);
  if (!s.ok()) return s;
  const int64_t row = static_cast<int64_t>(model_.num_kv_heads) * model_.head_dim;
  const char* k_bytes = req.k().data().data();
  const char* v_bytes = req.v().data().data();
  BatchTiming total;
  for (int64_t begin = 0; begin < n; begin += kAppendChunk) {
    const int64_t count = std::min(kAppendChunk, n - begin);
    std::memcpy(append_k_, k_bytes + begin * row * 2, count * row * 2);
    std::memcpy(append_v_, v_bytes + begin * row * 2, count * row * 2);
    std::fill_n(append_layer_, count, req.layer());
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
  s = cache.CommitWrite(work.key, req.layer(), req.start_position(), n, work.incarnation);
  if (!s.ok()) return s;
  metrics_->AddTokensAppended(n);
  spdlog::debug("prefill: {} tokens of layer {} at {}, compute {} us", n, req.layer(),
                req.start_position(), total.compute_us);
  return cache.Length(work.key, req.layer());
}

absl::StatusOr<int64_t> Executor::RunAppend(const AppendWork& work) {
  absl::StatusOr<int64_t> length = Append(work);
  if (!length.ok()) length = ForCaller(length.status(), work.key, work.request->sequence_id());
  return length;
}

}  // namespace sds::server
