// Units of work that travel from the RPC handlers through the batcher to the executor.
// A work item's request and response live in the RPC's reactor until `done` runs;
// `done` is called exactly once and must not block: from whichever thread runs the
// item's unit (the executor thread, the assembler's, or with --inline_idle_batches the
// submitting RPC thread), from the assembler or a claiming submitter for an item whose
// deadline passed in the queue, or from the thread that calls Batcher::Stop for an item
// still queued. (A refused submission is answered by its caller.)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/response_wire.h"
#include "server/tensor_bytes.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

using Clock = std::chrono::steady_clock;

// Where a decode's answer goes when it is not encoded into a reply (a DecodeLayer item):
// the executor calls it with the row's out [Hq, D] bf16 and lse [Hq] f32 (null unless
// the request asked for lse) before it commits the token; an error fails the item and
// nothing is committed.
using AnswerWriter = std::function<absl::Status(const uint16_t* out, const float* lse)>;

// One token of one layer: append k/v at `position`, then sparse top-K attention.
struct DecodeWork {
  const sparse_decode::v1::DecodeRequest* request = nullptr;
  // The request's tensor data: its own fields, or the call's received slices (a raw
  // Decode or DecodeBatch call, whose message fields then hold no data).
  DecodeTensorBytes bytes;
  // On OK the executor has set request_id and batch here, and written the whole answer,
  // out and lse (when asked) straight from staging, into `encoded` (required; the bytes
  // the calls send: response_wire.h). On an error the caller answers from `response`.
  sparse_decode::v1::DecodeResponse* response = nullptr;
  EncodedResponse* encoded = nullptr;
  // Instead of `encoded` (which is then null): where the executor writes the answer's
  // tensors; `response` still receives request_id and batch.
  AnswerWriter write_answer;
  // Optional, on the executor thread: before_run right before the batch runs (an error
  // drops the item with it, nothing run or stored), after_run once the batch has run and
  // its answers are written, for an item whose before_run succeeded; must not throw.
  // DecodeLayer pins the regions that the device writes during the run with them.
  std::function<absl::Status()> before_run;
  std::function<void()> after_run;
  std::string key;  // tenant-qualified sequence id (auth.h)
  // The sequence's PagedKvCache::Incarnation when the request was admitted: the work
  // fails NOT_FOUND if that sequence is released, whatever is created under the id later.
  uint64_t incarnation = 0;
  Clock::time_point deadline = Clock::time_point::max();
  Clock::time_point enqueued;       // set by the batcher
  std::function<bool()> cancelled;  // optional: the caller gave up (not run, CANCELLED)
  bool closes_batch = false;        // last item of a DecodeBatch call (eager batching)
  std::function<void(const absl::Status&)> done;
};

// Prefill: n tokens of one layer, no attention.
struct AppendWork {
  const sparse_decode::v1::AppendKVRequest* request = nullptr;
  std::string key;
  uint64_t incarnation = 0;  // as DecodeWork::incarnation
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
