// The executor side of the batcher: the only code that touches cache metadata for
// writes (PrepareWrite copy-on-write ordering) and the only caller of Backend::Run.
// Units run on the batcher's executor threads or (while they are idle) its assembler
// thread; the batcher's pipe mutex orders them. Decode batches may run side by side
// (BatcherOptions::max_concurrent_batches; never two of one sequence); a prefill runs
// alone.
// For a decode batch it prepares each request's slot, gathers page tables, runs the
// backend, commits the writes and completes the responses.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/backend.h"
#include "server/metrics.h"
#include "server/model_shape.h"
#include "server/staging.h"
#include "server/work.h"

namespace sds::server {

class Executor {
 public:
  static absl::StatusOr<std::unique_ptr<Executor>> Create(Backend* backend, Metrics* metrics,
                                                          const ModelShape& model);
  ~Executor();

  // The units' items, in order, were copied into the rows of `staging` by the assembler.
  // Completes every unit exactly once, with each item's outcome (if running the batch
  // throws: INTERNAL for each item not finished by then); does not throw unless a
  // completion's own failure handling does.
  // `before_answers` (may be empty; must not throw) runs once, after the batch has run
  // and its answers are written, before the first completion: from then on neither
  // `staging` nor this executor is used by this call, so the caller may hand both to
  // the next batch while the completions run (DecodeStream answers are posted to other
  // threads, each a wake-up on this one).
  void RunDecodeBatch(StagingBuffer& staging, std::vector<DecodeWork>& units,
                      const std::function<void()>& before_answers = {});
  // The prefill's new length, or why it failed (the caller answers `work.done`). Not run
  // when its deadline passed or its call was cancelled. May throw (bad_alloc).
  absl::StatusOr<int64_t> RunAppend(const AppendWork& work);
  // Called once, on the thread that ran the batch, when the backend reports itself lost
  // (IsBackendLost): the server stops serving. Set before any work runs.
  void OnBackendLost(std::function<void(const absl::Status&)> hook) {
    on_backend_lost_ = std::move(hook);
  }

 private:
  Executor(Backend* backend, Metrics* metrics, const ModelShape& model);
  // RunDecodeBatch without the completions: `status[r]` is row r's outcome (the units'
  // items in order; OK: its answer is written). May throw (bad_alloc); `*finished` then
  // says how many rows, from the first, have their final outcome (answer written and
  // committed, or refused).
  void RunBatch(StagingBuffer& staging, std::vector<DecodeWork>& units,
                std::vector<absl::Status>& status, size_t* finished);
  absl::StatusOr<int64_t> Append(const AppendWork& work);
  // A failed Run's answer for its requests: UNAVAILABLE when the backend is lost (after
  // calling the hook, once), RESOURCE_EXHAUSTED when it ran out of memory, else
  // INTERNAL "`what`: ...".
  absl::Status BackendFailure(const absl::Status& run_status, absl::string_view what);

  Backend* backend_;
  Metrics* metrics_;
  ModelShape model_;
  int32_t page_size_;
  std::atomic<uint64_t> next_batch_id_{1};
  std::function<void(const absl::Status&)> on_backend_lost_;
  std::atomic<bool> backend_lost_{false};
  // Prefill staging: [kAppendChunk, Hkv, D] bf16 K and V, layer and slot per row.
  static constexpr int64_t kAppendChunk = 1024;
  void* append_block_ = nullptr;
  uint16_t* append_k_ = nullptr;
  uint16_t* append_v_ = nullptr;
  int32_t* append_layer_ = nullptr;
  int64_t* append_slot_ = nullptr;
};

}  // namespace sds::server
