// Units of work that travel from the RPC layer through the batcher to the executor. No
// protobuf here: the RPC handlers turn their messages into these (wire_decode.h,
// layer_call.h, validate.h) and answer their calls from what comes back, so the bytes
// path (Decode, DecodeBatch, DecodeStream) and the shared-memory path (DecodeLayer) feed
// the batching engine the same thing.
//
// A decode unit (DecodeWork) is the items of one call that run in one batch: one for
// Decode and DecodeStream, up to a batch's worth for DecodeBatch and DecodeLayer (a
// call with more items, or with two of one (sequence, layer), is split into several
// units in order: decode_submit.h). The batcher takes whole units, so a packed call
// costs one queue entry, one deadline check and one completion per batch, not per item.
//
// A unit's completion runs exactly once and must not block: from whichever thread runs
// the unit (the executor thread, the assembler's, or with --inline_idle_batches the
// submitting RPC thread), from the assembler or a claiming submitter for a unit whose
// deadline passed in the queue, or from the thread that calls Batcher::Stop for a unit
// still queued. (A refused submission is answered by its caller.)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/tensor_bytes.h"

namespace sds::server {

using Clock = std::chrono::steady_clock;

class PendingWrites;

// One token of one layer, checked (validate.h): append k/v at `position`, then sparse
// top-K attention. Its tensors stay where the call received them (`bytes`).
struct DecodeItem {
  int32_t index = 0;              // the item's place in its call (DecodeSink's `index`)
  std::string key;                // tenant-qualified sequence id (auth.h)
  absl::string_view sequence_id;  // the caller's id, for messages; views the call's memory
  int32_t layer = 0;
  int64_t position = 0;
  // The index list: `topk` indices, or one list of `topk` per KV head.
  int32_t topk = 0;
  bool indices_per_kv_head = false;
  bool return_lse = false;
  // The sequence's PagedKvCache incarnation when the item was admitted: the work fails
  // NOT_FOUND if that sequence is released, whatever is created under the id later.
  uint64_t incarnation = 0;
  // q, gate [Hq, D] bf16; k, v [Hkv, D] bf16; indices [topk] or [Hkv, topk] int32.
  DecodeTensorBytes bytes;
};

// The batch that ran an item, as its answer reports it.
struct BatchInfo {
  uint64_t batch_id = 0;
  int32_t batch_size = 0;
  int64_t queue_us = 0;    // from the unit's submission to the batch's start
  int64_t compute_us = 0;  // the backend's time for the batch
};

// The RPC layer's side of a decode unit: where its answers go. Called on the thread that
// runs the unit; none of them may throw except on bad_alloc.
class DecodeSink {
 public:
  virtual ~DecodeSink() = default;
  // Right before the batch runs (after the deadline check): an error fails the unit's
  // items with it, nothing run or stored. DecodeLayer checks its regions and pins the
  // ones the device writes during the run.
  virtual absl::Status BeforeRun() { return absl::OkStatus(); }
  // Once the batch has run and its answers are written, when BeforeRun succeeded.
  virtual void AfterRun() {}
  // The answer of the call's item `index`: out [Hq, D] bf16 and lse [Hq] f32 (null unless
  // the item asked for it), valid during the call. Written before the token is committed:
  // an error fails the item and nothing is committed (an answer that cannot be delivered
  // leaves the cache as if the item was never sent).
  virtual absl::Status Write(int32_t index, const BatchInfo& batch, const uint16_t* out,
                             const float* lse) = 0;
  // With the outcome of some of a unit's items, status[i] items[i]'s: once per unit, or
  // once per item when one status answers them all (a unit refused or expired whole).
  virtual void Done(absl::Span<DecodeItem* const> items, absl::Span<const absl::Status> status) = 0;
};

// Items of one call that run in one batch: at most one per (sequence, layer), at most
// the batcher's max_batch_size.
struct DecodeWork {
  absl::InlinedVector<DecodeItem*, 1> items;  // owned by the call until Done
  DecodeSink* sink = nullptr;
  // Admission's counts of the items' queued tokens (pending_writes.h), removed right
  // before Done; null when nothing was counted.
  PendingWrites* pending = nullptr;
  Clock::time_point deadline = Clock::time_point::max();
  Clock::time_point enqueued;       // set by the batcher
  std::function<bool()> cancelled;  // optional: the caller gave up (not run, CANCELLED)
  // The last unit of a call that carries the runner's whole batch (DecodeBatch,
  // DecodeLayer): with eager batching its batch closes at once.
  bool closes_batch = false;
  int32_t size() const { return static_cast<int32_t>(items.size()); }
};

// Answers `work`: its pending counts removed, then its sink's Done. `status` holds one
// status per item, or one for all of them. Allocates nothing.
void Complete(DecodeWork& work, absl::Span<const absl::Status> status);

// Prefill: n tokens of one layer, no attention; checked (validate.h).
struct AppendWork {
  std::string key;  // tenant-qualified sequence id
  absl::string_view sequence_id;
  int32_t layer = 0;
  int64_t start_position = 0;
  int64_t num_tokens = 0;
  const char* k = nullptr;   // [num_tokens, Hkv, D] bf16, owned by the call
  const char* v = nullptr;   // [num_tokens, Hkv, D] bf16
  uint64_t incarnation = 0;  // as DecodeItem::incarnation
  Clock::time_point deadline = Clock::time_point::max();
  Clock::time_point enqueued;
  std::function<bool()> cancelled;  // optional: the caller gave up (not run, CANCELLED)
  std::function<void(absl::StatusOr<int64_t> length)> done;
};

// Cache metadata changes (fork, release) that must be ordered with launched batches:
// they run between batches, one unit at a time in queue order (on the executor thread,
// or on the assembler's when nothing else is queued). The batcher calls `run` (unless
// the deadline passed, the call was cancelled or the batcher stopped), then `done` once
// with run's status or the reason it did not run; `run` changes nothing it does not
// report through that status.
struct ControlWork {
  std::function<absl::Status()> run;
  Clock::time_point deadline = Clock::time_point::max();
  std::function<bool()> cancelled;  // optional
  std::function<void(const absl::Status&)> done;
};

// Why a unit whose deadline is `deadline` may not run at `now` (DEADLINE_EXCEEDED or
// CANCELLED), or OK. Checked right before a unit runs: a caller that has given up must
// not find its work done later (a fork that exists after its DEADLINE_EXCEEDED answer
// makes the retry fail ALREADY_EXISTS).
inline absl::Status CheckStillWanted(Clock::time_point now, Clock::time_point deadline,
                                     const std::function<bool()>& cancelled) {
  if (now > deadline) {
    return absl::DeadlineExceededError(
        "deadline passed while the request waited in the queue; it was not run");
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError("the call was cancelled before it ran; it was not run");
  }
  return absl::OkStatus();
}

}  // namespace sds::server
