#include "server/pending_writes.h"

#include "absl/strings/str_cat.h"

namespace sds::server {

absl::Status PendingWrites::CheckStart(const PagedKvCache& cache, const std::string& key,
                                       int32_t layer, int64_t start, const std::string& sequence_id,
                                       uint64_t* incarnation) const {
  // Pending first, then the length: a write that commits in between (commit happens
  // before its pending count is removed) can only make the bound larger, never smaller.
  int64_t queued = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(KeyRef(key, layer));
    if (it != pending_.end()) queued = it->second;
  }
  absl::StatusOr<int64_t> length = cache.Length(key, layer, incarnation);
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

void PendingWrites::Add(const std::string& key, int32_t layer, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(KeyRef(key, layer));
  if (it == pending_.end()) it = pending_.emplace(Key(key, layer), 0).first;
  it->second += tokens;
}

void PendingWrites::Remove(const std::string& key, int32_t layer, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(KeyRef(key, layer));
  if (it == pending_.end()) return;
  it->second -= tokens;
  if (it->second <= 0) pending_.erase(it);
}

}  // namespace sds::server
