// Sparse top-K GQA decode attention with fused sigmoid gate on the CPU, following the
// maths of DESIGN.md. Work is split into (request, KV head) items; each item reads its
// K/V rows once and serves all G = Hq / Hkv query heads of the group. An item's result
// depends only on its own request (fixed summation order), so outputs are batch
// invariant and independent of the thread count.
#pragma once

#include "kernels/cpu_thread_pool.h"
#include "kernels/decode_params.h"

namespace sds {

enum class CpuKernelPath {
  kAuto,        // the fastest of the paths below that this CPU and D support
  kPortable,    // plain C++ (lookup-table dequantisation)
  kAvx2,        // explicit AVX2/FMA/F16C (D % 16 == 0); else portable
  kAvx512Bf16,  // kAvx2 with AVX-512 BF16 dot products for q.k and zmm accumulation
                // of p.V (D % 32 == 0); else kAvx2
};

// True when this CPU can run the kAvx2 / kAvx512Bf16 paths.
bool CpuSupportsAvx2Path();
bool CpuSupportsAvx512Bf16Path();

// The path CpuDecode takes for `requested` on this CPU with head dimension D.
CpuKernelPath ResolveCpuKernelPath(CpuKernelPath requested, int head_dim);

// cache: host CacheView (see decode_params.h for every array's shape).
// batch: q, gate: [B, Hq, D] bf16; out: [B, Hq, D] bf16, every element written;
//   lse: [B, Hq] float32 or nullptr; indices as described in DecodeBatch (any
//   negative index is skipped; non-negative ones must be valid positions).
// pool: threads to use; nullptr runs everything on the calling thread.
void CpuDecode(const CacheView& cache, const DecodeBatch& batch, CpuThreadPool* pool,
               CpuKernelPath path = CpuKernelPath::kAuto);

}  // namespace sds
