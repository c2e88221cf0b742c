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
// In-place inputs: in a decode batch of at most in_place_inputs_max_requests requests
// (and as many appended tokens; a prefill, with no decode, is copied), the bulk tensors
// (q, gate [B, Hq, D] bf16; new K/V [N, Hkv, D] bf16) too large for the input pack
// (input_upload.h), which would each be a copy of their own, are read by the kernels
// straight from the mapped staging (q by each of a request's chunk CTAs, one per 512
// indices, at its start, overlapping its index -> page table -> row chain; gate
// prefetched towards L2 by them, then read by the finishing CTA; new K/V once, by the
// append). Measured on the H200 (bench/gpu/backend_bench.cc,
// session 12, three runs, against direct outputs alone): device time per batch of the
// seed shape 52.7-53.7 -> 37.5-38.8 us at 32 requests, 80.6-84.0 -> 58.0-62.9 at 64,
// 120.8-125.5 -> 97.2-104.3 at 128, 204.5-206.7 -> 168.4-173.4 at 256; at 8 requests
// -3 to -25 % (seed) and -7 to +6 % (2048 indices); at one request, where q and gate
// travel in the pack, reading them in place cost 1.5 us more, so packed inputs are not
// read in place. The index lists and page tables stay uploaded: read in place by the
// decode (each CTA re-reads them, in its dependent chain) every input measured slower
// than the copy, up to 2.4x at 8 x 2048 indices and 2.8x at 16 x 2048, and even at one
// request (session 6). The kernels and their arithmetic are the same either way, so the
// outputs are bit-identical (tests/gpu/backend_direct_test.cc).
#pragma once

#include <cstdint>
#include <limits>
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
  // Decode batches of at most this many requests read q and gate in place, and the new
  // K/V of their appends of at most this many tokens, when too large for the pack (0: never;
  // the default: any size, 256 being the largest measured, where it still won by 16 %).
  // Inputs outside memory from AllocateStaging are always uploaded.
  int32_t in_place_inputs_max_requests = std::numeric_limits<int32_t>::max();
  // Lanes (1-8): each its own stream, events, input pack, split-K workspace and batch
  // buffers, so that as many Runs (batches of disjoint sequences, from as many threads)
  // overlap on the device; Backend::max_concurrent_runs() reports it, and the server runs
  // that many decode batches at once (--concurrent_batches). Each lane holds ~3 x
  // max_batch_size x Hq x D x 2 bytes of batch buffers plus its workspace. 1 by default:
  // two lanes give the one-lane bits on the H200 (backend_direct_test.cc), but at the
  // seed shape they gained nothing end to end beyond the spread (bench/RESULTS.md,
  // session 17).
  int32_t lanes = 1;
};

// The defaults above, overridden by the environment (diagnostics):
// SDS_CUDA_DIRECT_OUT_MAX_REQUESTS=N (0 turns direct outputs off), SDS_CUDA_LOG_PHASES=1,
// SDS_CUDA_IN_PLACE_INPUTS_MAX_REQUESTS=N (0 uploads every input), SDS_CUDA_LANES=N.
CudaBackendOptions CudaBackendOptionsFromEnv();

// CreateCudaBackend(config) is this with CudaBackendOptionsFromEnv().
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendConfig& config,
                                                           const CudaBackendOptions& options);

// Where the last Run of a CUDA backend put its outputs (tests, benchmark): true when
// the decode wrote them into staging, false when they were copied back (or, for lse,
// when the batch asked for none); and which inputs the kernels read in place.
struct CudaBatchPath {
  bool direct_out = false;
  bool direct_lse = false;
  bool in_place_q = false;       // q and gate read from staging
  bool in_place_new_kv = false;  // the append's new K/V read from staging
};
// All false for a backend that does not come from CreateCudaBackend.
CudaBatchPath LastCudaBatchPath(const Backend& backend);

}  // namespace sds
