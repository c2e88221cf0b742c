// Small device helpers for the sm_90a kernels: FP8 pair conversion, the m16n8k16 f16
// tensor-core MMA, 16-byte cp.async with zero fill, fast base-2 exponentials, the
// programmatic dependent launch controls and the cluster primitives (split barrier,
// mbarriers, asynchronous stores into another CTA's shared memory).
#pragma once

#include <cstdint>

namespace sds::cuda {

// Programmatic dependent launch (Hopper PDL). A kernel launched with programmatic
// stream serialization may start before the previous kernel of its stream has finished;
// GridDependencyWait returns once that kernel has completed and its memory operations
// are visible to this grid (a no-op in a grid launched without the attribute). Only
// reads of what the previous kernel writes must follow it.
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
// Lets the dependent grid be scheduled once every CTA of this grid has issued it (or
// exited). Scheduling only: it makes no memory visible; the dependent's
// GridDependencyWait still waits for this grid to complete.
__device__ __forceinline__ void AllowDependentLaunch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Four E4M3 bytes (one 32-bit word, byte 0 lowest) -> two f16x2 words:
// lo = {byte0, byte1}, hi = {byte2, byte3} (the lower byte lands in the lower half).
__device__ __forceinline__ void Fp8x4ToHalf2x2(uint32_t word, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 l, h;\n\t"
      "mov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
}

// Two f32 -> one f16x2 word (round to nearest even), `first` in the lower half.
__device__ __forceinline__ uint32_t PackHalf2(float first, float second) {
  uint32_t out;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(second), "f"(first));
  return out;
}

// Two f32 -> the f16x2 words `hi` (as PackHalf2) and `lo` = the rounding residuals, so
// that hi + lo carries about 22 significant bits. Probabilities go through the P*V MMA
// as hi and lo: f16 alone keeps 11 bits, which left errors of 2 bf16 ulps in outputs
// where the V rows cancel (seen in the server's integration tests on the H200).
__device__ __forceinline__ void PackHalf2Split(float first, float second, uint32_t& hi,
                                               uint32_t& lo) {
  hi = PackHalf2(first, second);
  float first_hi, second_hi;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\t"
      "cvt.f32.f16 %1, h;\n\t}"
      : "=f"(first_hi), "=f"(second_hi)
      : "r"(hi));
  lo = PackHalf2(first - first_hi, second - second_hi);
}

// The warp's 8x8 b16 matrix, one f16x2 word per lane (lane holds row lane / 4, columns
// 2 (lane % 4), + 1), transposed in the same layout (movmatrix).
__device__ __forceinline__ uint32_t TransposeHalf8x8(uint32_t word) {
  uint32_t out;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(word));
  return out;
}

// c[4] += A(16x16, row) * B(16x8, col); f16 inputs, f32 accumulators.
__device__ __forceinline__ void MmaF16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t SmemAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy that bypasses L1; fills zeros when !valid.
__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* global, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr),
               "l"(global), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// 2^x with the MUFU approximation (relative error ~2^-22); 2^-inf = 0.
__device__ __forceinline__ float FastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint4 LoadShared16(const uint8_t* ptr) {
  return *reinterpret_cast<const uint4*>(ptr);
}

// ---- Thread block clusters: split cluster barrier, mbarriers, stores into another CTA. ----
// The cluster barrier in two halves: every thread of every CTA of the cluster arrives
// once, and a thread's wait returns once all of them have arrived. Relaxed: the arrive
// orders no memory by itself (FenceMbarrierInitCluster orders an mbarrier.init before it).
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
// mbarrier at shared address `bar` (8-byte aligned) of this CTA, expecting `count` arrivals.
__device__ __forceinline__ void MbarrierInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes this thread's earlier mbarrier.init visible to the cluster (before its arrive).
__device__ __forceinline__ void FenceMbarrierInitCluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival on `bar` that also expects `bytes` of asynchronous stores (complete_tx).
__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits for phase `parity` of `bar` to complete, with acquire at cluster scope: what other
// CTAs' st.async wrote under it is visible afterwards.
__device__ __forceinline__ void MbarrierWaitCluster(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// The shared::cluster address of shared address `addr` in the cluster's CTA `rank`.
__device__ __forceinline__ uint32_t ClusterMapShared(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
// Stores 4 bytes at `remote` (a shared::cluster address) without waiting; its completion
// counts 4 bytes against the mbarrier `remote_bar` (in the same CTA as `remote`).
__device__ __forceinline__ void StoreAsyncCluster(uint32_t remote, float value,
                                                  uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote),
      "r"(__float_as_uint(value)), "r"(remote_bar)
      : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of
// 32): the calling warps wait for each other, with the ordering of shared memory that
// __syncthreads gives.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace sds::cuda
