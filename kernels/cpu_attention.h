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
  kAuto,      // AVX2+FMA+F16C when the CPU has it and D % 16 == 0, else portable
  kPortable,  // plain C++ (lookup-table dequantisation)
  kAvx2,      // explicit AVX2/FMA/F16C; falls back to portable when unsupported
};

// True when this CPU can run the AVX2 path.
bool CpuSupportsAvx2Path();

// cache: host CacheView (see decode_params.h for every array's shape).
// batch: q, gate: [B, Hq, D] bf16; out: [B, Hq, D] bf16, every element written;
//   lse: [B, Hq] float32 or nullptr; indices as described in DecodeBatch (any
//   negative index is skipped; non-negative ones must be valid positions).
// pool: threads to use; nullptr runs everything on the calling thread.
void CpuDecode(const CacheView& cache, const DecodeBatch& batch, CpuThreadPool* pool,
               CpuKernelPath path = CpuKernelPath::kAuto);

}  // namespace sds
