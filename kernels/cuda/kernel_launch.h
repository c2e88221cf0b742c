// Raw kernel launchers (no absl in .cu translation units). decode.cc validates the
// shapes, builds the parameter structs and turns the cudaError_t into an absl::Status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/decode_params_cuda.h"
#include "kernels/decode_params.h"

namespace sds::cuda {

// The v1 decode's warps for G <= 8 (ignored above; same bits every way): one warp per
// warp sequence, a second warp per sequence for its P*V, that with QK one step ahead, or
// picked from the grid size (DecodePvWarpChoice).
enum class V1Warps : int32_t { kAuto = -1, kFused = 0, kPvWarp = 1, kPvWarpQkAhead = 2 };

// Enqueues the sparse decode kernel: grid (Hkv, max_chunks, B). head_dim 64/128/256,
// group 1..16 (checked by the caller). pdl: with programmatic stream serialization (the
// CTAs may start before the previous kernel of the stream ends). Returns the launch's
// error.
cudaError_t EnqueueSparseDecode(const DecodeParams& params, int32_t head_dim, int32_t num_requests,
                                bool per_token_head, V1Warps warps, bool pdl, cudaStream_t stream);

// What V1Warps::kAuto picks for a v1 grid of `ctas` CTAs (kFused where G > 8), and the
// resident CTAs per SM of the PV-warp instance it compares against (0 where G > 8; may
// be null). head_dim 64/128/256, else cudaErrorInvalidValue.
cudaError_t DecodePvWarpChoice(int32_t head_dim, int32_t group, bool per_token_head, int64_t ctas,
                               V1Warps* warps, int* pv_ctas_per_sm = nullptr);

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
