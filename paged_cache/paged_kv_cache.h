// The paged FP8 KV cache: a pool of fixed-size pages shared by every layer, block
// tables per sequence, reference counts for forks with copy-on-write, and the
// per-(token, KV head) scale storage of per_token_head mode. Metadata lives on the
// host; the bytes live in a PageMemory. Thread-safe (one internal mutex).
//
// Ordering contract: PrepareWrite may copy pages (copy-on-write); callers invoke it
// from the thread that launches backend work, right before that work, so the copy
// is ordered with the kernels (see PageMemory::Copy).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/decode_params.h"
#include "paged_cache/page_memory.h"

namespace sds {

struct CacheConfig {
  int32_t num_layers = 1;
  int32_t num_kv_heads = 8;
  int32_t head_dim = 128;
  int32_t page_size = 16;  // power of two
  int64_t num_pages = 0;   // > 0
  ScaleMode scale_mode = ScaleMode::kPerTensor;
  std::vector<float> layer_k_scales;  // [num_layers], per_tensor mode; empty = all 1.0
  std::vector<float> layer_v_scales;
  // Limits per tenant (the `tenant` a sequence is created for; its forks keep it); 0 =
  // none. Pages count once per tenant however many of its sequences share them. The
  // empty tenant (the server's own sequences, callers that name none) has no limits.
  int64_t max_pages_per_tenant = 0;
  int64_t max_sequences_per_tenant = 0;
};

struct CacheStats {
  int64_t pages_total = 0;
  int64_t pages_used = 0;
  int64_t pages_free = 0;
  int64_t sequences = 0;
  int64_t tokens = 0;  // sum over sequences of the longest written layer
};

class PagedKvCache {
 public:
  // Bytes one page costs across all layers, K, V and scales.
  static int64_t BytesPerPage(const CacheConfig& config);
  // Validates the config (INVALID_ARGUMENT with the reason) and allocates the pool.
  static absl::StatusOr<std::unique_ptr<PagedKvCache>> Create(const CacheConfig& config,
                                                              std::unique_ptr<PageMemory> memory);
  ~PagedKvCache();

  // ALREADY_EXISTS if `id` is taken; RESOURCE_EXHAUSTED if the reservation
  // (ceil(reserve_tokens / page_size) pages, allocated now) does not fit, or `tenant`
  // would pass one of its limits (CacheConfig::max_*_per_tenant; the message names it).
  absl::Status CreateSequence(const std::string& id, int64_t reserve_tokens,
                              const std::string& tenant = "");
  // Shares every page of `src` with `dst` (reference counts); `dst` belongs to `src`'s
  // tenant. NOT_FOUND, ALREADY_EXISTS, RESOURCE_EXHAUSTED (the tenant's sequence limit).
  absl::Status ForkSequence(const std::string& src, const std::string& dst);
  // Frees the sequence's pages at once (shared pages lose one reference). NOT_FOUND.
  // Returns the number of pages that went back to the free list.
  absl::StatusOr<int64_t> ReleaseSequence(const std::string& id);

  // Makes positions [start, start + n) of `layer` writable and returns their slots
  // (page_id * page_size + offset) in `slots` (resized to n). Allocates pages that
  // do not exist yet and copies shared pages before they are written (copy-on-write).
  // NOT_FOUND (sequence), INVALID_ARGUMENT (layer, n, start < 0),
  // FAILED_PRECONDITION (start > written length of the layer: a gap),
  // RESOURCE_EXHAUSTED ("needs X pages, Y free"). On error nothing changed.
  // `incarnation` (here, in CommitWrite and AppendPageTable): 0 for whichever sequence
  // has the id, else the value Incarnation returned when the caller accepted its work;
  // a sequence released and created again since is then NOT_FOUND.
  absl::Status PrepareWrite(const std::string& id, int32_t layer, int64_t start, int64_t n,
                            std::vector<int64_t>* slots, uint64_t incarnation = 0);
  // Records that positions [start, start + n) of `layer` now hold data:
  // length(layer) = max(length(layer), start + n).
  absl::Status CommitWrite(const std::string& id, int32_t layer, int64_t start, int64_t n,
                           uint64_t incarnation = 0);

  // Appends the sequence's page ids (logical page order) to `pages`.
  absl::Status AppendPageTable(const std::string& id, std::vector<int32_t>* pages,
                               uint64_t incarnation = 0) const;
  // A number given to the sequence when it was created or forked, never given again
  // (never 0): queued work carries it so that a release cannot let it land on a new
  // sequence of the same id. NOT_FOUND.
  absl::StatusOr<uint64_t> Incarnation(const std::string& id) const;
  // Written length of `layer` (positions 0..length-1 hold data). NOT_FOUND, INVALID_ARGUMENT.
  // `incarnation` (optional) receives the sequence's Incarnation from the same lookup.
  absl::StatusOr<int64_t> Length(const std::string& id, int32_t layer,
                                 uint64_t* incarnation = nullptr) const;
  bool Contains(const std::string& id) const;

  CacheStats Stats() const;
  // `tenant`'s own use: pages_used (its pages, shared ones once) and sequences; pages_total
  // is its page limit (0 = none), pages_free what is left of it (or of the pool, if less).
  CacheStats TenantStats(const std::string& tenant) const;
  const CacheConfig& config() const;
  // Pointers into the PageMemory; layer scale pointers refer to host copies owned by
  // the cache (a device backend uploads its own).
  CacheView view() const;
  PageMemory& memory();

 private:
  PagedKvCache() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sds
