// Raw kernel launchers (no absl in .cu translation units). decode.cc validates the
// shapes, builds the parameter structs and turns the cudaError_t into an absl::Status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/decode_params_cuda.h"
#include "kernels/decode_params.h"

namespace sds::cuda {

// Enqueues the sparse decode kernel: grid (Hkv, max_chunks, B). head_dim 64/128/256,
// group 1..16 (checked by the caller). pv_warp (G <= 8; ignored above): 0 without a PV
// warp per warp sequence, 1 with, 2 with and QK one step ahead, -1 to pick from the grid
// size (same bits).
// pdl: with programmatic stream serialization (the CTAs may start before the previous
// kernel of the stream ends). Returns the launch's error.
cudaError_t EnqueueSparseDecode(const DecodeParams& params, int32_t head_dim, int32_t num_requests,
                                bool per_token_head, int pv_warp, bool pdl, cudaStream_t stream);

// The PV-warp mode (0, 1, 2 as for EnqueueSparseDecode) that pv_warp -1 picks for a v1
// grid of `ctas` CTAs (0 where G > 8), and the resident CTAs per SM of the PV-warp
// instance it compares against (0 where G > 8; may be null). head_dim 64/128/256, else
// cudaErrorInvalidValue.
cudaError_t DecodePvWarpChoice(int32_t head_dim, int32_t group, bool per_token_head, int64_t ctas,
                               int* pv_warp, int* pv_ctas_per_sm = nullptr);

// Enqueues the v2 decode kernel (decode_v2_kernel.cuh): grid (fine ? max_units : 1,
// Hkv / heads_per_cta, B), then, when fine and max_units > 1, the merge kernel (Hkv, B).
// Returns cudaErrorInvalidValue for a bad heads_per_cta or head_dim.
cudaError_t EnqueueSparseDecodeV2(const DecodeParams& params, int32_t head_dim,
                                  int32_t num_requests, bool per_token_head, cudaStream_t stream);

// Resident CTAs per SM of the head_dim 128 decode kernel (benchmark diagnostics).
cudaError_t DecodeOccupancy(int32_t head_dim, int32_t group, bool per_token_head, int* blocks);

// Enqueues the append kernel (D / 8 lanes per (token, KV head, K|V) row). cache and
// append hold device pointers; head_dim 64/128/256.
cudaError_t EnqueueAppend(const CacheView& cache, const AppendBatch& append, cudaStream_t stream);

}  // namespace sds::cuda
