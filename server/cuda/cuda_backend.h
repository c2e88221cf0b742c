// CUDA backend knobs beyond server/backend.h: where small batches' outputs go, for the
// server (defaults from the environment), the GPU tests and the benchmark.
//
// Direct outputs: the staging memory is pinned and mapped into the device address space
// (cudaHostAllocMapped, device address from cudaHostGetDevicePointer), and for a batch of
// at most direct_out_max_requests requests the decode writes out [B, Hq, D] and lse
// [B, Hq] straight into it instead of into device buffers copied back afterwards: one
// copy fewer per batch (its copy-engine latency and host API call). Measured on the H200
// (bench/gpu/backend_bench.cc, 22:19 UTC, two processes of copy/direct/direct/copy):
// compute time per batch 26-29 -> 21-25 us at one request of the seed shape, 30-35 ->
// 24-28 us at one request of 2048 indices, 263-269 -> 220-222 us at 256 seed requests.
// Inputs are still uploaded: read in place over PCIe by the decode (each CTA re-reads q,
// its index list and its page table entries, in its dependent chain) they measured
// slower than the copy, up to 2.4x at 8 x 2048 indices and 2.8x at 16 x 2048, and even
// at one request (27-29 us against 23-25 with direct outputs alone). The kernels and
// their arithmetic are the same either way, so the outputs are bit-identical
// (tests/gpu/backend_direct_test.cc).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/backend.h"

namespace sds {

struct CudaBackendOptions {
  // Batches of at most this many decode requests write their outputs into staging
  // (0: never; 256 is the largest batch measured, where it still won by 17 %). Outputs
  // outside memory from AllocateStaging are always copied back.
  int32_t direct_out_max_requests = 256;
  // Logs each batch's device time by phase (input copies, append, decode and output
  // copies; CUDA events between them) at info level. Diagnostics: the events keep the
  // decode from overlapping the append (programmatic dependent launch).
  bool log_phases = false;
};

// The defaults above, overridden by the environment (diagnostics):
// SDS_CUDA_DIRECT_OUT_MAX_REQUESTS=N (0 turns direct outputs off), SDS_CUDA_LOG_PHASES=1.
CudaBackendOptions CudaBackendOptionsFromEnv();

// CreateCudaBackend(config) is this with CudaBackendOptionsFromEnv().
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendConfig& config,
                                                           const CudaBackendOptions& options);

// Where the last Run of a CUDA backend put its outputs (tests, benchmark): true when
// the decode wrote them into staging, false when they were copied back (or, for lse,
// when the batch asked for none).
struct CudaBatchPath {
  bool direct_out = false;
  bool direct_lse = false;
};
// All false for a backend that does not come from CreateCudaBackend.
CudaBatchPath LastCudaBatchPath(const Backend& backend);

}  // namespace sds
