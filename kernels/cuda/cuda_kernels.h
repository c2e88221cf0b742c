// Public API of the CUDA kernels: batched append (bf16 -> FP8 paged cache) and batched
// sparse top-K GQA decode with fused sigmoid gate. All pointers inside CacheView,
// AppendBatch and DecodeBatch must be device pointers (layer scale arrays included).
// Calls only enqueue work on `stream`; errors carry the failing step's name.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "kernels/decode_params.h"

namespace sds::cuda {

// absl::Status from a CUDA error code: INTERNAL "<what>: <cuda error name>: <text>".
absl::Status CudaCall(cudaError_t err, std::string_view what);

// INVALID_ARGUMENT unless head_dim is 64/128/256, Hq is a multiple of Hkv with
// G = Hq / Hkv in 1..16, and the cache's rows per layer fit in int32.
absl::Status CheckDecodeShape(int32_t num_q_heads, const CacheGeometry& geo);

// Split-K scratch of LaunchDecode; device memory owned by the caller.
struct DecodeWorkspace {
  float* partial = nullptr;  // [capacity_floats]
  int64_t capacity_floats = 0;
  int32_t* counters = nullptr;  // [capacity_counters], zeroed once before first use
  int64_t capacity_counters = 0;
};

// Which decode kernel LaunchDecode runs. kDefault: SDS_DECODE_KERNEL=v1|v2 from the
// environment, read once per process (v1 when unset). v1: CTA per (request, KV head,
// 512-index chunk); a request's chunks merge in a cluster (the other chunks push their
// partials into chunk 0's shared memory) when the batch's longest list has 2..8 chunks,
// the grid has at most one CTA per SM (SDS_DECODE_CLUSTER_MERGE=2: any size) and its
// clusters fit the GPU at once, else through a global workspace (always with
// kV1GlobalMerge or SDS_DECODE_CLUSTER_MERGE=0; same bits either way). v2: CTA per
// (request, KV heads group[, 64-index unit]), batch size picks the split (kV2Coarse /
// kV2Fine force one, for tests and benchmarks).
// v1 with G <= 8 gives each warp sequence a second warp for its P*V when the grid is
// small (one wave of 8-warp CTAs), whose softmax warp also computes QK one step ahead
// when the grid has at most one CTA per SM, or as SDS_DECODE_PV_WARP=0|1|2 in the
// environment says (diagnostics); kV1Fused / kV1PvWarp / kV1PvWarpQkAhead force one
// (tests, benchmarks). Same bits.
enum class DecodeKernel : int32_t {
  kDefault = 0,
  kV1 = 1,
  kV2 = 2,
  kV2Coarse = 3,
  kV2Fine = 4,
  kV1GlobalMerge = 5,
  kV1Fused = 6,
  kV1PvWarp = 7,
  kV1PvWarpQkAhead = 8
};

// Chunks (CTAs per (request, KV head)) for a list of `topk` indices:
// ceil(topk / kDecodeChunkTokens), >= 1 (512 in the default build).
int32_t DecodeChunks(int32_t topk);
// Largest top-K per list LaunchDecode accepts (65536).
int32_t DecodeMaxTopK();
// Workspace sizes for `num_requests` requests of at most `max_topk` indices per list
// (enough for v1 and for v2's fine split of up to kDecodeV2FineMaxUnits units).
int64_t DecodeWorkspaceFloats(int32_t num_requests, int32_t num_q_heads, int32_t head_dim,
                              int32_t max_topk);
int64_t DecodeWorkspaceCounters(int32_t num_requests, int32_t num_kv_heads);

// One launch for the whole batch (v2 fine split: plus a merge launch). `max_topk` is the
// largest batch.topk[b] (host value). batch.q, batch.gate and batch.out must be 8-byte
// aligned and workspace.partial 16-byte aligned (INVALID_ARGUMENT otherwise). Every kernel gives
// the same bits for a request whatever the batch; v1 and v2 agree within rounding, not bitwise.
// host_batch (optional): host copies of the batch's [B] arrays layer, page_table_offset,
// index_offset, topk and indices_per_kv_head, equal to the device ones (its other
// pointers are not read). With at most DecodeInlineRequests() requests, v1 then takes
// them from its launch parameters instead of global memory (one dependent load fewer;
// same bits).
// after_append: the previous work on `stream` is the batch's append kernel (LaunchAppend),
// and nothing but it may still be writing what the decode reads. v1 is then launched
// with programmatic dependent launch: its CTAs load Q and resolve their index lists and
// page tables while the append runs and read the cache only once the append has
// completed (same bits). SDS_DECODE_PDL=0 in the environment turns this off
// (diagnostics); v2 ignores it.
absl::Status LaunchDecode(const CacheView& cache, const DecodeBatch& batch, int32_t max_topk,
                          const DecodeWorkspace& workspace, cudaStream_t stream,
                          DecodeKernel kernel = DecodeKernel::kDefault,
                          const DecodeBatch* host_batch = nullptr, bool after_append = false);
// Largest batch whose per-request scalars travel in v1's launch parameters (16).
int32_t DecodeInlineRequests();

// One launch quantising every row of `append` into the cache (both scale modes).
absl::Status LaunchAppend(const CacheView& cache, const AppendBatch& append, cudaStream_t stream);

}  // namespace sds::cuda
