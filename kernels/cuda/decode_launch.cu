// Dispatch of the sparse decode kernel over head_dim, group tile and scale mode.
#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cuda {
namespace {

template <int D, int kRows, bool kPerToken>
cudaError_t Launch(const DecodeParams& params, int32_t num_requests, cudaStream_t stream) {
  constexpr int kSmem = DecodeTile<D, kPerToken>::kSmemBytes;
  auto* kernel = &SparseDecodeKernel<D, kRows, kPerToken>;
  // Once per process and instance: raise the dynamic shared memory limit and ask for
  // the largest shared-memory carveout (three CTAs of ~72 KB per SM).
  static const cudaError_t configured = [&] {
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return e;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                static_cast<int>(cudaSharedmemCarveoutMaxShared));
  }();
  if (configured != cudaSuccess) return configured;
  const dim3 grid(params.num_kv_heads, params.max_chunks, num_requests);
  kernel<<<grid, kDecodeThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchForDim(const DecodeParams& params, int32_t num_requests, bool per_token,
                         cudaStream_t stream) {
  const bool wide = params.group > 8;
  if (per_token) {
    return wide ? Launch<D, 16, true>(params, num_requests, stream)
                : Launch<D, 8, true>(params, num_requests, stream);
  }
  return wide ? Launch<D, 16, false>(params, num_requests, stream)
              : Launch<D, 8, false>(params, num_requests, stream);
}

}  // namespace

cudaError_t DecodeOccupancy(int32_t head_dim, int32_t group, bool per_token_head, int* blocks) {
  *blocks = 0;
  if (head_dim != 128) return cudaErrorInvalidValue;
  auto occ = [&](auto* kernel, int smem) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kDecodeThreads, smem);
  };
  const bool wide = group > 8;
  if (per_token_head)
    return wide ? occ(&SparseDecodeKernel<128, 16, true>, DecodeTile<128, true>::kSmemBytes)
                : occ(&SparseDecodeKernel<128, 8, true>, DecodeTile<128, true>::kSmemBytes);
  return wide ? occ(&SparseDecodeKernel<128, 16, false>, DecodeTile<128, false>::kSmemBytes)
              : occ(&SparseDecodeKernel<128, 8, false>, DecodeTile<128, false>::kSmemBytes);
}

cudaError_t EnqueueSparseDecode(const DecodeParams& params, int32_t head_dim, int32_t num_requests,
                                bool per_token_head, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return LaunchForDim<64>(params, num_requests, per_token_head, stream);
    case 128:
      return LaunchForDim<128>(params, num_requests, per_token_head, stream);
    case 256:
      return LaunchForDim<256>(params, num_requests, per_token_head, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sds::cuda
