// Shared-memory regions of the data plane: memory that a runner on the server's host
// shares with it (a POSIX shared-memory object, or a CUDA allocation through CUDA IPC),
// registered under a name by one tenant and then referenced by DecodeLayer tensors.
//
// Lifetime: the registry holds each region by shared_ptr, and so does every call that
// references it, from admission until its last item is answered; unregistering drops
// the registry's reference and revokes the region (Revoke), so the memory stays mapped
// under a queued or running batch but nothing is written to it any more: a runner that
// unregistered a region may reuse its memory at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sds::server {

enum class RegionKind { kSystem, kCuda };
const char* RegionKindName(RegionKind kind);  // "system" | "cuda"

class Region {
 public:
  // `unmap` releases the mapping (munmap, cudaIpcCloseMemHandle); it runs once, when the
  // last reference goes.
  Region(std::string name, RegionKind kind, char* base, uint64_t byte_size,
         std::function<void()> unmap);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const std::string& name() const { return name_; }
  RegionKind kind() const { return kind_; }
  uint64_t byte_size() const { return byte_size_; }
  // Host address of byte 0 (system) or device address (cuda).
  char* base() const { return base_; }

  // One mechanism keeps writes off a revoked region: a write holds a pin (Pin .. Unpin,
  // which may run on another thread, as a batch's run on the device does), Pin fails
  // FAILED_PRECONDITION once the region is revoked, and Revoke waits for the pins held:
  // once it returns, nothing writes to the region.
  absl::Status Pin() const;
  void Unpin() const;
  // Runs `write` under a pin; FAILED_PRECONDITION (not run) when revoked.
  absl::Status WriteIfLive(const std::function<void()>& write) const;
  bool revoked() const { return revoked_.load(std::memory_order_acquire); }
  void Revoke();

  // Calls that reference the region and have not been answered (ListRegions).
  mutable std::atomic<int64_t> calls_in_flight{0};

 private:
  const std::string name_;
  const RegionKind kind_;
  char* const base_;
  const uint64_t byte_size_;
  std::function<void()> unmap_;
  mutable std::mutex mu_;  // guards pins_ and the revocation
  mutable std::condition_variable unpinned_;
  mutable int64_t pins_ = 0;
  // Set under mu_; read without it by revoked() (every item of a call checks its regions).
  std::atomic<bool> revoked_{false};
};

// Maps [offset, offset + byte_size) of the POSIX shared-memory object `shm_name`
// ("/name": one leading slash, no other) read-write. INVALID_ARGUMENT for a bad name or
// a range past the object's size, NOT_FOUND when no such object exists,
// PERMISSION_DENIED when the server may not open it.
absl::StatusOr<std::shared_ptr<Region>> MapSystemRegion(const std::string& name,
                                                        const std::string& shm_name,
                                                        uint64_t offset, uint64_t byte_size);

struct RegionLimits {
  int32_t max_regions_per_tenant = 64;             // --max_regions_per_tenant
  uint64_t max_region_bytes = uint64_t{64} << 30;  // --max_region_bytes, per region
};

struct RegionTotals {
  int64_t system_regions = 0, cuda_regions = 0;
  uint64_t system_bytes = 0, cuda_bytes = 0;
};

// The registered regions of every tenant. Thread-safe.
class RegionRegistry {
 public:
  explicit RegionRegistry(RegionLimits limits) : limits_(limits) {}

  // Checks the name and the limits, then calls `map` (which maps the memory) and keeps
  // the region under (tenant, name). ALREADY_EXISTS when the tenant has one of that
  // name, RESOURCE_EXHAUSTED past a limit.
  absl::Status Register(const std::string& tenant, const std::string& name, uint64_t byte_size,
                        const std::function<absl::StatusOr<std::shared_ptr<Region>>()>& map);
  // Revokes and drops the tenant's region `name` (every region of the tenant when
  // `name` is empty); returns how many. NOT_FOUND for a name the tenant has not
  // registered.
  absl::StatusOr<int> Unregister(const std::string& tenant, const std::string& name);
  // NOT_FOUND unless the tenant registered `name` (another tenant's region is not found).
  absl::StatusOr<std::shared_ptr<Region>> Find(const std::string& tenant,
                                               const std::string& name) const;
  // The tenant's regions, by name.
  std::vector<std::shared_ptr<Region>> List(const std::string& tenant) const;
  RegionTotals Totals() const;

 private:
  const RegionLimits limits_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Region>>
      regions_;  // by tenant, name
};

}  // namespace sds::server
