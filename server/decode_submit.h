// Admission of a call's decode items: existence and position gap (pending_writes.h) for
// all of them under one lock, then the queue as units (work.h) of at most a batch each.
// Shared by Decode, DecodeBatch, DecodeStream and DecodeLayer, which check their
// messages first (validate.h, layer_call.h).
#pragma once

#include <functional>
#include <vector>

#include "absl/types/span.h"
#include "paged_cache/paged_kv_cache.h"
#include "server/batcher.h"
#include "server/pending_writes.h"
#include "server/work.h"

namespace sds::server {

class DecodeAdmission {
 public:
  DecodeAdmission(Batcher* batcher, const PagedKvCache* cache, PendingWrites* pending)
      : batcher_(batcher), cache_(cache), pending_(pending) {}

  // Queues a call's checked items (validate.h; index and key set) for `sink`: each
  // item's sequence must exist (NOT_FOUND) and its position follow its layer's length
  // plus the tokens queued for it (FAILED_PRECONDITION). The admitted items go to the
  // batcher as units in order, each of at most Batcher::max_batch_size items and at most
  // one per (sequence, layer), in one step. `whole_batch`: the call carries the runner's
  // whole batch (DecodeBatch, DecodeLayer), so with --eager_batching its last unit closes
  // its batch at once; a Decode or DecodeStream item waits to be batched with others.
  // Every item is answered exactly once through sink->Done; one refused here is answered
  // at once, from this thread. The items, the data their bytes view and `sink` must
  // outlive their Done. `claim` (single-item calls only): see Batcher::SubmitDecode.
  // Does not throw.
  void Submit(absl::Span<DecodeItem* const> items, DecodeSink* sink, Clock::time_point deadline,
              const std::function<bool()>& cancelled, bool whole_batch,
              Batcher::SubmitterRun* claim = nullptr) const;

 private:
  // The admitted items (status[i] OK) as units in order, the others with their status
  // in `refused`. May throw (bad_alloc).
  void BuildUnits(absl::Span<DecodeItem* const> items, std::vector<absl::Status>& status,
                  DecodeSink* sink, Clock::time_point deadline,
                  const std::function<bool()>& cancelled, bool whole_batch,
                  std::vector<DecodeItem*>* refused, std::vector<absl::Status>* refused_status,
                  std::vector<DecodeWork>* units) const;

  Batcher* batcher_;
  const PagedKvCache* cache_;
  PendingWrites* pending_;
};

}  // namespace sds::server
