#include "server/pending_writes.h"

#include "absl/strings/str_cat.h"

namespace sds::server {

namespace {

// CheckStart's verdict from the layer's length (or why there is none) and its queued tokens.
absl::Status StartVerdict(const absl::StatusOr<int64_t>& length, int64_t queued, int32_t layer,
                          int64_t start, absl::string_view sequence_id) {
  if (length.status().code() == absl::StatusCode::kNotFound) {
    return absl::NotFoundError(
        absl::StrCat("sequence '", sequence_id, "' not found; call CreateSequence first"));
  }
  if (!length.ok()) return length.status();
  if (start > *length + queued) {
    return absl::FailedPreconditionError(
        absl::StrCat("position ", start, " of layer ", layer, " needs positions 0..", start - 1,
                     " written first; sequence '", sequence_id, "' has ", *length, " in that layer",
                     queued > 0 ? absl::StrCat(" (+", queued, " queued)") : std::string()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PendingWrites::CheckStart(const PagedKvCache& cache, const std::string& key,
                                       int32_t layer, int64_t start, const std::string& sequence_id,
                                       uint64_t* incarnation) const {
  // Pending first, then the length: a write that commits in between (commit happens
  // before its pending count is removed) can only make the bound larger, never smaller.
  int64_t queued = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(KeyOf(key, layer));
    if (it != pending_.end()) queued = it->second;
  }
  return StartVerdict(cache.Length(key, layer, incarnation), queued, layer, start, sequence_id);
}

void PendingWrites::CheckAndAddItems(const PagedKvCache& cache, absl::Span<DecodeItem* const> items,
                                     absl::Span<absl::Status> status) {
  // The lock is held across the lengths: a commit in between only makes a bound larger
  // (as in CheckStart), and no other unit's count can change under the check.
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < items.size(); ++i) {
    DecodeItem& item = *items[i];
    auto it = pending_.find(KeyOf(item.key, item.layer));
    const int64_t queued = it != pending_.end() ? it->second : 0;
    uint64_t incarnation = 0;
    status[i] = StartVerdict(cache.Length(item.key, item.layer, &incarnation), queued, item.layer,
                             item.position, item.sequence_id);
    if (!status[i].ok()) continue;
    item.incarnation = incarnation;
    if (it == pending_.end()) it = pending_.emplace(KeyOf(item.key, item.layer), 0).first;
    ++it->second;
  }
}

void PendingWrites::Reserve(size_t items) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.reserve(pending_.size() + items);
}

void PendingWrites::RemoveItems(absl::Span<DecodeItem* const> items) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const DecodeItem* item : items) {
    auto it = pending_.find(KeyOf(item->key, item->layer));
    if (it == pending_.end()) continue;
    if (--it->second <= 0) pending_.erase(it);
  }
}

void PendingWrites::Add(const std::string& key, int32_t layer, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(KeyOf(key, layer));
  if (it == pending_.end()) it = pending_.emplace(KeyOf(key, layer), 0).first;
  it->second += tokens;
}

void PendingWrites::Remove(const std::string& key, int32_t layer, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(KeyOf(key, layer));
  if (it == pending_.end()) return;
  it->second -= tokens;
  if (it->second <= 0) pending_.erase(it);
}

}  // namespace sds::server
