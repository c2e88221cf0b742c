#include "kernels/cuda/device_rows.h"

namespace sds::cuda {
namespace {

constexpr int kThreads = 256;

// True when one of the eight bf16 values in `w` is NaN or Inf (all exponent bits set).
__device__ bool NonFinite8(const uint4 w) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bad |= (words[i] & 0x7F80u) == 0x7F80u;
    bad |= (words[i] & 0x7F800000u) == 0x7F800000u;
  }
  return bad;
}

// Copies `count` bf16 values (a multiple of 8, both ends 16-byte aligned) and reports
// whether any was not finite.
__device__ bool CopyChecked(uint16_t* dst, const uint16_t* src, int64_t count) {
  bool bad = false;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  for (int64_t i = threadIdx.x; i < count / 8; i += blockDim.x) {
    const uint4 w = s[i];
    bad |= NonFinite8(w);
    d[i] = w;
  }
  return bad;
}

__global__ void __launch_bounds__(kThreads) GatherDeviceRows(const GatherRowsParams p) {
  const int32_t b = blockIdx.x;
  const DeviceRowSource src = p.rows[b];
  if (src.q == nullptr) return;  // a host row, staged and uploaded as usual
  const int64_t q_elems = static_cast<int64_t>(p.num_q_heads) * p.head_dim;
  const int64_t kv_elems = static_cast<int64_t>(p.num_kv_heads) * p.head_dim;
  bool non_finite = CopyChecked(p.q + b * q_elems, src.q, q_elems);
  non_finite |= CopyChecked(p.gate + b * q_elems, src.gate, q_elems);
  non_finite |= CopyChecked(p.k_new + b * kv_elems, src.k, kv_elems);
  non_finite |= CopyChecked(p.v_new + b * kv_elems, src.v, kv_elems);
  const int32_t k = p.topk[b];
  const int lists = p.indices_per_kv_head[b] ? p.num_kv_heads : 1;
  int32_t* dst = p.indices + p.index_offset[b];
  bool bad_index = false;
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(k) * lists; i += blockDim.x) {
    const int64_t list = i / k, at = i % k;
    const int32_t index = src.indices[list * src.index_stride + at];
    bad_index |= index < -1 || index > src.position;
    dst[i] = index;
  }
  const int non_finite_any = __syncthreads_or(non_finite);
  const int bad_index_any = __syncthreads_or(bad_index);
  if (!non_finite_any && !bad_index_any) {
    if (threadIdx.x == 0) p.row_error[b] = kRowOk;
    return;
  }
  // Invalid: nothing stored, nothing read (every index skipped).
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(k) * lists; i += blockDim.x) dst[i] = -1;
  if (threadIdx.x == 0) {
    p.slot[b] = -1;
    p.row_error[b] = non_finite_any ? kRowNonFinite : kRowBadIndex;
  }
}

__global__ void __launch_bounds__(kThreads) ScatterDeviceOutputs(const ScatterRowsParams p) {
  const int32_t b = blockIdx.x;
  const DeviceRowSource dst = p.rows[b];
  if (dst.q == nullptr || p.row_error[b] != kRowOk) return;
  const int64_t q_elems = static_cast<int64_t>(p.num_q_heads) * p.head_dim;
  if (dst.out != nullptr) {
    const uint4* s = reinterpret_cast<const uint4*>(p.out + b * q_elems);
    uint4* d = reinterpret_cast<uint4*>(dst.out);
    for (int64_t i = threadIdx.x; i < q_elems / 8; i += blockDim.x) d[i] = s[i];
  }
  if (dst.lse != nullptr && p.lse != nullptr) {
    for (int32_t h = threadIdx.x; h < p.num_q_heads; h += blockDim.x)
      dst.lse[h] = p.lse[static_cast<int64_t>(b) * p.num_q_heads + h];
  }
}

}  // namespace

cudaError_t EnqueueGatherDeviceRows(const GatherRowsParams& params, cudaStream_t stream) {
  if (params.num_rows <= 0) return cudaSuccess;
  GatherDeviceRows<<<params.num_rows, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t EnqueueScatterDeviceOutputs(const ScatterRowsParams& params, cudaStream_t stream) {
  if (params.num_rows <= 0) return cudaSuccess;
  ScatterDeviceOutputs<<<params.num_rows, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace sds::cuda
