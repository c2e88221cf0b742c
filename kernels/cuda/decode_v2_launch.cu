// Dispatch of the v2 sparse decode kernel (and its fine-split merge kernel) over
// head_dim, group tile and scale mode.
#include "kernels/cuda/decode_v2_kernel.cuh"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cuda {
namespace {

// Once per process and instance: raise the dynamic shared memory limit to the largest
// CTA (kDecodeV2MaxHeads heads) and ask for the largest shared-memory carveout.
template <int D, int kRows, bool kPerToken>
cudaError_t ConfigureV2() {
  static const cudaError_t error = [] {
    auto* kernel = &SparseDecodeV2Kernel<D, kRows, kPerToken>;
    const int smem = V2Tile<D, kPerToken>::SmemBytes(kDecodeV2MaxHeads);
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                static_cast<int>(cudaSharedmemCarveoutMaxShared));
  }();
  return error;
}

template <int D, int kRows, bool kPerToken>
cudaError_t LaunchV2(const DecodeParams& p, int32_t num_requests, cudaStream_t stream) {
  if (cudaError_t e = ConfigureV2<D, kRows, kPerToken>(); e != cudaSuccess) return e;
  const int smem = V2Tile<D, kPerToken>::SmemBytes(p.heads_per_cta);
  const dim3 grid(p.fine ? p.max_units : 1, p.num_kv_heads / p.heads_per_cta, num_requests);
  SparseDecodeV2Kernel<D, kRows, kPerToken><<<grid, p.heads_per_cta * 32, smem, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (!p.fine || p.max_units <= 1) return cudaSuccess;
  SparseDecodeV2MergeKernel<D, kPerToken>
      <<<dim3(p.num_kv_heads, num_requests), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchV2ForDim(const DecodeParams& p, int32_t num_requests, bool per_token,
                           cudaStream_t stream) {
  const bool wide = p.group > 8;
  if (per_token) {
    return wide ? LaunchV2<D, 16, true>(p, num_requests, stream)
                : LaunchV2<D, 8, true>(p, num_requests, stream);
  }
  return wide ? LaunchV2<D, 16, false>(p, num_requests, stream)
              : LaunchV2<D, 8, false>(p, num_requests, stream);
}

}  // namespace

cudaError_t EnqueueSparseDecodeV2(const DecodeParams& params, int32_t head_dim,
                                  int32_t num_requests, bool per_token_head, cudaStream_t stream) {
  const int h = params.heads_per_cta;
  if (h < 1 || h > kDecodeV2MaxHeads || (h & (h - 1)) != 0 || params.num_kv_heads % h != 0)
    return cudaErrorInvalidValue;
  switch (head_dim) {
    case 64:
      return LaunchV2ForDim<64>(params, num_requests, per_token_head, stream);
    case 128:
      return LaunchV2ForDim<128>(params, num_requests, per_token_head, stream);
    case 256:
      return LaunchV2ForDim<256>(params, num_requests, per_token_head, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sds::cuda
