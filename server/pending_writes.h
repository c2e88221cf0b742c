// Tokens queued but not yet committed, per (sequence key, layer). Admission uses them
// to reject a position gap before queueing while still accepting pipelined requests
// (position p+1 sent before p has run): the position is checked against the written
// length plus everything still queued for that layer. The executor's PrepareWrite
// remains the authority; this check only answers obvious gaps early.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "paged_cache/paged_kv_cache.h"

namespace sds::server {

class PendingWrites {
 public:
  // NOT_FOUND for an unknown sequence; FAILED_PRECONDITION when `start` lies beyond
  // the layer's length plus its queued tokens. `sequence_id` is for the message.
  absl::Status CheckStart(const PagedKvCache& cache, const std::string& key, int32_t layer,
                          int64_t start, const std::string& sequence_id) const;
  void Add(const std::string& key, int32_t layer, int64_t tokens);
  void Remove(const std::string& key, int32_t layer, int64_t tokens);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::pair<std::string, int32_t>, int64_t> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sds::server
