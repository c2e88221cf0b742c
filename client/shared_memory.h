// The C++ client's side of the shared-memory data plane (DecodeLayer): a POSIX
// shared-memory region this process creates and the server maps, and the packed layer
// batch whose tensors lie in it. The server must run with --allow_client_shm on the
// same host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/decode_client.h"

namespace sds::client {

// `bytes` of fresh POSIX shared memory, mapped read-write; unlinked and unmapped on
// destruction (the server's mapping, if any, stays valid until it unregisters).
class SharedMemoryRegion {
 public:
  // A unique "/sds-<pid>-<n>" object. RESOURCE_EXHAUSTED or the errno's text on failure.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(size_t bytes);
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& shm_name() const { return shm_name_; }
  char* data() const { return data_; }
  size_t size() const { return bytes_; }
  // The offset of `p` inside the region (p must lie in it).
  uint64_t OffsetOf(const void* p) const {
    return static_cast<uint64_t>(static_cast<const char*>(p) - data_);
  }

 private:
  SharedMemoryRegion(std::string shm_name, char* data, size_t bytes)
      : shm_name_(std::move(shm_name)), data_(data), bytes_(bytes) {}
  std::string shm_name_;
  char* data_;
  size_t bytes_;
};

// Bytes [offset, offset + bytes) of the registered region `region`.
struct RegionSlice {
  std::string region;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// One layer's batch of B items whose tensors lie in registered regions (shapes as in
// DecodeLayerRequest): q, gate [B, Hq, D] bf16; k, v [B, Hkv, D] bf16; indices [B, K] or
// [B, Hkv, K] int32 (-1 = skip); out [B, Hq, D] bf16, written by the server.
struct LayerBatch {
  int32_t layer = 0;
  std::vector<std::string> sequence_ids;  // [B]
  std::vector<int64_t> positions;         // [B]
  int32_t topk = 0;                       // K
  bool per_kv_head_indices = false;       // indices [B, Hkv, K]
  RegionSlice q, gate, k, v, indices, out;
  uint64_t request_id = 0;
};

// The answer of a DecodeLayer call: each item's status (OK: its out row is written) and
// the BatchInfo of the last batch that ran an item.
struct LayerResult {
  std::vector<absl::Status> items;
  BatchStats batch;
};

absl::Status RegisterSystemRegion(DecodeClient& client, const std::string& name,
                                  const SharedMemoryRegion& region, const CallOptions& call = {});
absl::Status UnregisterRegion(DecodeClient& client, const std::string& name,
                              const CallOptions& call = {});
// The outer status is the call's (a bad shape or reference: nothing ran), the inner ones
// the items'.
absl::StatusOr<LayerResult> DecodeLayer(DecodeClient& client, const LayerBatch& batch,
                                        const CallOptions& call = {});

}  // namespace sds::client
