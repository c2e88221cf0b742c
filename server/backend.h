// The one interface between the server and the attention maths. The server fills
// host staging buffers (allocated through AllocateStaging, so the CUDA backend can
// pin them) and calls Run from the batcher's threads: at most max_concurrent_runs()
// calls at once, each for a batch whose sequences no other running batch holds; Run
// returns when every output is in host memory. Implementations: cpu_backend (kernels/cpu_*) and
// cuda_backend (kernels/cuda/*).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"
#include "kernels/decode_params.h"
#include "paged_cache/paged_kv_cache.h"

namespace sds {

// The longest poll BackendConfig::cpu_prewake_us may ask of the CPU backend's workers.
inline constexpr int32_t kMaxCpuPrewakeUs = 10000;

struct BackendConfig {
  CacheConfig cache;  // num_pages already resolved
  int32_t num_q_heads = 32;
  int32_t max_batch_size = 256;
  int32_t max_topk = 2048;  // largest K per request (per KV head for [Hkv, K])
  int32_t cpu_threads = 0;  // 0 = UsableCpus() (affinity and cgroup quota)
  // CPU backend: how long its pool's workers poll for a batch announced by Prewake
  // (CpuThreadPool::Prewake), 0 .. kMaxCpuPrewakeUs; 0 = Prewake does nothing. The
  // server's default is --cpu_prewake_us (1000).
  int32_t cpu_prewake_us = 0;
};

// One unit of backend work: first the append (quantise new K/V into the cache),
// then the attention. Either part may be empty (num_tokens == 0 or num_requests == 0).
// All pointers are host pointers into staging buffers.
struct BatchWork {
  AppendBatch append;
  DecodeBatch decode;
};

// A runner's device allocation opened in this process through CUDA IPC; closed
// (cudaIpcCloseMemHandle) when destroyed.
class DeviceMapping {
 public:
  virtual ~DeviceMapping() = default;
  // The region's byte 0 on the backend's device: the allocation's base plus the offset.
  virtual void* device_address() const = 0;
};

struct BatchTiming {
  int64_t compute_us = 0;  // device time on CUDA (events), wall time on CPU
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu" | "cuda"
  virtual PagedKvCache& cache() = 0;
  // Host memory for staging (pinned on CUDA). Freed with FreeStaging.
  virtual void* AllocateStaging(size_t bytes) = 0;
  virtual void FreeStaging(void* ptr) = 0;
  // Runs the work synchronously. Errors are INTERNAL (a bug or a device fault), or
  // BackendLostError when the backend can run nothing any more.
  virtual absl::Status Run(const BatchWork& work, BatchTiming* timing) = 0;
  // Runs that may overlap to advantage (CUDA: one per lane, each with its own stream and
  // buffers). Run is safe to call concurrently either way (beyond this many calls wait).
  virtual int max_concurrent_runs() const { return 1; }
  // A hint from the request path that a batch is on its way (a DecodeBatch message is
  // being checked and staged): a backend with idle threads may wake them now, so that
  // they are running when Run comes. gathered_rows: the batch's K/V rows (sum over its
  // requests of K x Hkv), for a backend that uses its threads only for larger batches.
  // Default: nothing.
  virtual void Prewake(int64_t /*gathered_rows*/) {}
  // Opens [offset, offset + byte_size) of the device allocation that `ipc_handle` (the 64
  // bytes of a cudaIpcMemHandle_t from another process) names on device `device_id`.
  // INVALID_ARGUMENT for a handle of the wrong size or another device, UNAVAILABLE when
  // the driver refuses it (with its error); UNIMPLEMENTED by a backend without device
  // memory.
  // Whether Run accepts DecodeBatch::device_rows (rows whose tensors are in memory that
  // OpenCudaIpcRegion mapped).
  virtual bool reads_device_rows() const { return false; }
  virtual absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenCudaIpcRegion(
      absl::string_view /*ipc_handle*/, int32_t /*device_id*/, uint64_t /*offset*/,
      uint64_t /*byte_size*/) {
    return absl::UnimplementedError(
        "this server's backend has no device memory: register a system region instead");
  }
};

// A Run error after which the backend can run nothing again: the CUDA context is lost to
// a sticky device fault (an illegal address, a failed launch, an uncorrectable ECC
// error), so every later batch would fail too. UNAVAILABLE, marked by a payload; the
// server then stops serving and exits non-zero for its supervisor to restart it (a
// process that answered every request with an error while its health check said
// SERVING would never be replaced).
inline constexpr char kBackendLostPayload[] = "type.googleapis.com/sds.BackendLost";
inline absl::Status BackendLostError(absl::string_view message) {
  absl::Status status = absl::UnavailableError(message);
  status.SetPayload(kBackendLostPayload, absl::Cord("lost"));
  return status;
}
inline bool IsBackendLost(const absl::Status& status) {
  return status.GetPayload(kBackendLostPayload).has_value();
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const BackendConfig& config);
// Defined only when built with CUDA (SDS_HAVE_CUDA). UNAVAILABLE without a GPU.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendConfig& config);
// OK when built with CUDA and a usable GPU is present; else why not: NOT_FOUND when
// there is no GPU (or no CUDA in this build), another code when one is there but cannot
// be used (its compute capability, the driver), with the device and the CUDA error.
absl::Status CudaDeviceStatus();
inline bool CudaDeviceAvailable() { return CudaDeviceStatus().ok(); }

}  // namespace sds
