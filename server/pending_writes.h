// Tokens queued but not yet committed, per (sequence key, layer). Admission uses them
// to reject a position gap before queueing while still accepting pipelined requests
// (position p+1 sent before p has run): the position is checked against the written
// length plus everything still queued for that layer. The executor's PrepareWrite
// remains the authority; this check only answers obvious gaps early.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "paged_cache/paged_kv_cache.h"
#include "server/work.h"

namespace sds::server {

class PendingWrites {
 public:
  // NOT_FOUND for an unknown sequence; FAILED_PRECONDITION when `start` lies beyond
  // the layer's length plus its queued tokens. `sequence_id` is for the message.
  // `incarnation` (optional) receives the sequence's PagedKvCache::Incarnation as seen
  // by this check: the one that queued work is then bound to.
  absl::Status CheckStart(const PagedKvCache& cache, const std::string& key, int32_t layer,
                          int64_t start, const std::string& sequence_id,
                          uint64_t* incarnation = nullptr) const;
  void Add(const std::string& key, int32_t layer, int64_t tokens);
  void Remove(const std::string& key, int32_t layer, int64_t tokens);
  // Admits a unit's items in one step, under one lock: each item's position is checked
  // as CheckStart does (counting the unit's earlier items of the same (sequence, layer)
  // as queued), then counted as one queued token. status[i] is items[i]'s verdict; an
  // item that fails is not counted, and its incarnation is left as it was.
  void CheckAndAddItems(const PagedKvCache& cache, absl::Span<DecodeItem* const> items,
                        absl::Span<absl::Status> status);
  // Room for `items` more entries, so that CheckAndAddItems of that many allocates
  // nothing (may throw bad_alloc, before anything is counted).
  void Reserve(size_t items);
  // One queued token of each item gone (the unit was answered).
  void RemoveItems(absl::Span<DecodeItem* const> items);

 private:
  // (the sequence key's 64-bit hash, layer): no copy of the key per queued item (an
  // entry comes and goes with every decode). Two sequences whose keys collide would share
  // a count, which only loosens this advisory check for them (PrepareWrite still refuses
  // a gap).
  using Key = std::pair<uint64_t, int32_t>;
  static Key KeyOf(absl::string_view key, int32_t layer) { return {absl::HashOf(key), layer}; }

  // std::mutex, not absl::Mutex: taken three times per request, and the packaged
  // abseil's debug deadlock detection made each absl::Mutex lock cost a graph lookup.
  mutable std::mutex mu_;                      // guards pending_
  absl::flat_hash_map<Key, int64_t> pending_;  // tokens queued
};

// Tokens of an AppendKV added to PendingWrites and not yet owned by its queued work's
// `done` (which removes them when the prefill completes). The destructor removes them unless
// Release() was called, so an error or an exception (bad_alloc) between the Add and a successful
// submit cannot leave the count too high for good.
class PendingHold {
 public:
  PendingHold() = default;
  // Adds `tokens` (after copying the key: a failed copy adds nothing).
  PendingHold(PendingWrites* pending, std::string key, int32_t layer, int64_t tokens)
      : key_(std::move(key)), layer_(layer), tokens_(tokens) {
    pending->Add(key_, layer_, tokens_);
    pending_ = pending;
  }
  PendingHold(PendingHold&& other) noexcept
      : pending_(std::exchange(other.pending_, nullptr)),
        key_(std::move(other.key_)),
        layer_(other.layer_),
        tokens_(other.tokens_) {}
  PendingHold& operator=(PendingHold&& other) noexcept {
    if (this != &other) {
      Undo();
      pending_ = std::exchange(other.pending_, nullptr);
      key_ = std::move(other.key_);
      layer_ = other.layer_;
      tokens_ = other.tokens_;
    }
    return *this;
  }
  ~PendingHold() { Undo(); }

  // Removes the tokens now (before answering an error, so that a retry sees them gone).
  void Undo() {
    if (PendingWrites* p = std::exchange(pending_, nullptr)) p->Remove(key_, layer_, tokens_);
  }
  // The tokens belong to a queued work item's `done` now.
  void Release() { pending_ = nullptr; }

 private:
  PendingWrites* pending_ = nullptr;
  std::string key_;
  int32_t layer_ = 0;
  int64_t tokens_ = 0;
};

}  // namespace sds::server
