// Sparse top-K GQA decode attention with fused sigmoid gate on the CPU, following the
// maths of DESIGN.md. Work is split into (request, block of KV heads) items; each KV
// head's K/V rows are read once and serve all G = Hq / Hkv query heads of the group.
// When a request's indices are shared by all KV heads, the AVX-512 path computes the
// block's heads together (each token slot's Hkv * D bytes read as one contiguous run).
// A head's arithmetic depends only on its own request (fixed summation order, the same
// whatever block it is in), so outputs are batch invariant and independent of the
// thread count; the block size may follow the batch size.
#pragma once

#include "kernels/cpu_thread_pool.h"
#include "kernels/decode_params.h"

namespace sds {

enum class CpuKernelPath {
  kAuto,        // the fastest of the paths below that this CPU and D support
  kPortable,    // plain C++ (lookup-table dequantisation)
  kAvx2,        // explicit AVX2/FMA/F16C (D % 16 == 0); else portable
  kAvx512Bf16,  // kAvx2 with AVX-512 BF16 dot products for q.k and zmm accumulation
                // of p.V (D % 32 == 0); else kAvx2. With AVX-512 VBMI, D % 64 == 0 and
                // G in {1, 2, 4}: keys looked up as bf16 (vpermi2b), fused KV heads.
};

// True when this CPU can run the kAvx2 / kAvx512Bf16 paths.
bool CpuSupportsAvx2Path();
bool CpuSupportsAvx512Bf16Path();

// The path CpuDecode takes for `requested` on this CPU with head dimension D.
CpuKernelPath ResolveCpuKernelPath(CpuKernelPath requested, int head_dim);

// The fewest gathered K/V rows (sum over requests of K x Hkv) for which CpuDecode uses
// its pool; smaller batches run on the calling thread.
int64_t CpuDecodeMinPooledRows();

// cache: host CacheView (see decode_params.h for every array's shape).
// batch: q, gate: [B, Hq, D] bf16; out: [B, Hq, D] bf16, every element written;
//   lse: [B, Hq] float32 or nullptr; indices as described in DecodeBatch (any
//   negative index is skipped; non-negative ones must be valid positions).
// pool: threads to use; nullptr runs everything on the calling thread.
void CpuDecode(const CacheView& cache, const DecodeBatch& batch, CpuThreadPool* pool,
               CpuKernelPath path = CpuKernelPath::kAuto);

}  // namespace sds
