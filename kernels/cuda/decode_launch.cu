// Dispatch of the sparse decode kernel over head_dim, group tile and scale mode.
#include <atomic>

#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cuda {
namespace {

// Once per process and instance: raise the dynamic shared memory limit, ask for the
// largest shared-memory carveout and read the resident CTAs per SM and the SM count.
struct KernelConfig {
  cudaError_t error = cudaSuccess;
  int ctas_per_sm = 0;
  int sms = 0;
};

// Ring depth of an instance: one stage more with PV warps, whose two warps keep kStages - 2
// in flight (each its half of a stage; see SparseDecodeKernel's prologue), and one more with
// QK one step ahead (kStages - 3 in flight ahead of the QK).
template <int D, bool kPvWarp, bool kQkAhead>
inline constexpr int kLaunchStages = kDecodeDefaultStages<D> + (kPvWarp ? 1 : 0) +
                                     (kQkAhead ? 1 : 0);

template <int D, int kRows, bool kPerToken, bool kPvWarp, bool kQkAhead = false>
const KernelConfig& Configure() {
  static const KernelConfig config = [] {
    constexpr int kStages = kLaunchStages<D, kPvWarp, kQkAhead>;
    using T = DecodeTile<D, kRows, kPerToken, kStages, kPvWarp>;
    constexpr int kSmem = T::kSmemBytes;
    auto* kernel = &SparseDecodeKernel<D, kRows, kPerToken, kStages, kPvWarp, kQkAhead>;
    KernelConfig c;
    // The limit covers a cluster launch's receive area too (occupancy is asked for kSmem).
    const int max_smem =
        kSmem + (T::kClusterMergeFits ? T::ClusterRecvBytes(T::kMaxClusterChunks) : 0);
    c.error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
    if (c.error != cudaSuccess) return c;
    c.error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   static_cast<int>(cudaSharedmemCarveoutMaxShared));
    if (c.error != cudaSuccess) return c;
    c.error =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.ctas_per_sm, kernel, T::kThreads, kSmem);
    if (c.error != cudaSuccess) return c;
    int device = 0;
    c.error = cudaGetDevice(&device);
    if (c.error != cudaSuccess) return c;
    c.error = cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, device);
    return c;
  }();
  return config;
}

// Clusters of `chunks` CTAs of this instance (with their receive area) that the GPU holds
// at once, asked once per instance and cluster size (cudaOccupancyMaxActiveClusters);
// 0 when the query fails, which turns the cluster merge off.
template <int D, int kRows, bool kPerToken, bool kPvWarp, bool kQkAhead>
int MaxActiveClusters(int chunks) {
  constexpr int kStages = kLaunchStages<D, kPvWarp, kQkAhead>;
  using T = DecodeTile<D, kRows, kPerToken, kStages, kPvWarp>;
  static std::atomic<int> asked[T::kMaxClusterChunks + 1];  // clusters + 1; 0: not asked
  int known = asked[chunks].load(std::memory_order_relaxed);
  if (known > 0) return known - 1;
  cudaLaunchConfig_t query = {};
  query.gridDim = dim3(1, chunks, 1);
  query.blockDim = dim3(T::kThreads);
  query.dynamicSmemBytes = T::kSmemBytes + T::ClusterRecvBytes(chunks);
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = static_cast<unsigned>(chunks);
  cluster.val.clusterDim.z = 1;
  query.attrs = &cluster;
  query.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(
          &clusters, &SparseDecodeKernel<D, kRows, kPerToken, kStages, kPvWarp, kQkAhead>,
          &query) != cudaSuccess) {
    cudaGetLastError();  // clear it: the launch goes on without clusters
    clusters = 0;
  }
  asked[chunks].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

template <int D, int kRows, bool kPerToken, bool kPvWarp, bool kQkAhead = false>
cudaError_t Launch(DecodeParams params, int32_t num_requests, bool pdl, cudaStream_t stream) {
  constexpr int kStages = kLaunchStages<D, kPvWarp, kQkAhead>;
  using T = DecodeTile<D, kRows, kPerToken, kStages, kPvWarp>;
  constexpr int kSmem = T::kSmemBytes;
  auto* kernel = &SparseDecodeKernel<D, kRows, kPerToken, kStages, kPvWarp, kQkAhead>;
  const KernelConfig& config = Configure<D, kRows, kPerToken, kPvWarp, kQkAhead>();
  if (config.error != cudaSuccess) return config.error;
  const dim3 grid(params.num_kv_heads, params.max_chunks, num_requests);
  // Split requests merge in a cluster (chunk 0's shared memory receives the partials)
  // where the instance fits it, a cluster of max_chunks CTAs is portable (<= 8: top-K <=
  // 4096), the grid is at most one CTA per SM (cluster_merge 2: any size) and all its
  // clusters fit the GPU at once (a second wave costs more than the merge saves), if the
  // caller allows. Pushed into chunk 0, the merge took 1 request from 13.3-13.5 to
  // 12.4-12.5 us on the H200; at 8 requests (two CTAs per SM) clusters cost 18 %
  // (bench/RESULTS.md, session 11). Same bits either way.
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  params.cluster_merge =
      params.cluster_merge != 0 && T::kClusterMergeFits && params.max_chunks >= 2 &&
      params.max_chunks <= T::kMaxClusterChunks &&
      (ctas <= config.sms || params.cluster_merge == 2) &&
      static_cast<int64_t>(grid.x) * grid.z <=
          MaxActiveClusters<D, kRows, kPerToken, kPvWarp, kQkAhead>(params.max_chunks);
  cudaLaunchConfig_t launch = {};
  launch.gridDim = grid;
  launch.blockDim = dim3(T::kThreads);
  // Cluster launches add chunk 0's receive area (every CTA gets it).
  launch.dynamicSmemBytes =
      kSmem + (params.cluster_merge ? T::ClusterRecvBytes(params.max_chunks) : 0);
  launch.stream = stream;
  cudaLaunchAttribute attrs[2];
  // Programmatic dependent launch: the CTAs may start while the previous kernel of the
  // stream runs (the kernel waits for it before its first cache read).
  auto add_pdl = [&] {
    if (!pdl) return;
    cudaLaunchAttribute& a = attrs[launch.numAttrs++];
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
  };
  // Without clusters: one CTA merges through the global workspace.
  auto launch_plain = [&] {
    params.cluster_merge = 0;
    launch.dynamicSmemBytes = kSmem;
    launch.numAttrs = 0;
    launch.attrs = attrs;
    add_pdl();
    return cudaLaunchKernelEx(&launch, kernel, params);
  };
  if (!params.cluster_merge) return launch_plain();
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 1;
  attrs[0].val.clusterDim.y = static_cast<unsigned>(params.max_chunks);  // cluster rank = chunk
  attrs[0].val.clusterDim.z = 1;
  launch.attrs = attrs;
  launch.numAttrs = 1;
  add_pdl();
  const cudaError_t err = cudaLaunchKernelEx(&launch, kernel, params);
  if (err != cudaErrorInvalidClusterSize && err != cudaErrorLaunchOutOfResources) return err;
  // The context cannot place such a cluster (e.g. a partitioned GPU): clear the error
  // and merge through the global workspace instead (same bits; a plain launch that still
  // fails reports its own error).
  cudaGetLastError();
  return launch_plain();
}

// V1Warps::kAuto's choice for a grid of `ctas` CTAs (see LaunchNarrow); pv_ctas_per_sm
// (may be null): the PV-warp instance's resident CTAs per SM.
template <int D, bool kPerToken>
cudaError_t PickPvWarp(int64_t ctas, V1Warps* warps, int* pv_ctas_per_sm = nullptr) {
  *warps = V1Warps::kFused;
  if (pv_ctas_per_sm != nullptr) *pv_ctas_per_sm = 0;
  if constexpr (kDecodeWarps == 4) {
    const KernelConfig& c = Configure<D, 8, kPerToken, true>();
    if (c.error != cudaSuccess) return c.error;
    if (ctas <= c.sms)
      *warps = V1Warps::kPvWarpQkAhead;
    else if (ctas <= static_cast<int64_t>(c.sms) * c.ctas_per_sm)
      *warps = V1Warps::kPvWarp;
    if (pv_ctas_per_sm != nullptr) *pv_ctas_per_sm = c.ctas_per_sm;
  }
  return cudaSuccess;
}

// G <= 8: with or without PV warps (same bits, see SparseDecodeKernel). V1Warps::kAuto
// picks QK-ahead PV warps when the grid has at most one CTA per SM, PV warps when it
// fits their CTAs in one wave (small batches, where a lone warp per scheduler leaves
// most issue slots idle), else fused warps; the other values force one. Builds with 8 warp
// sequences (-DSDS_DECODE_WARPS=8, an experiment) have no PV warps: twice as many warps would cap
// registers at 64 and need more named barriers than there are.
template <int D, bool kPerToken>
cudaError_t LaunchNarrow(const DecodeParams& params, int32_t num_requests, V1Warps warps, bool pdl,
                         cudaStream_t stream) {
  if constexpr (kDecodeWarps != 4) {
    return Launch<D, 8, kPerToken, false>(params, num_requests, pdl, stream);
  } else {
    if (warps == V1Warps::kAuto) {
      const int64_t ctas =
          static_cast<int64_t>(params.num_kv_heads) * params.max_chunks * num_requests;
      const cudaError_t err = PickPvWarp<D, kPerToken>(ctas, &warps);
      if (err != cudaSuccess) return err;
    }
    switch (warps) {
      case V1Warps::kPvWarpQkAhead:
        return Launch<D, 8, kPerToken, true, true>(params, num_requests, pdl, stream);
      case V1Warps::kPvWarp:
        return Launch<D, 8, kPerToken, true>(params, num_requests, pdl, stream);
      default:
        return Launch<D, 8, kPerToken, false>(params, num_requests, pdl, stream);
    }
  }
}

template <int D>
cudaError_t LaunchForDim(const DecodeParams& params, int32_t num_requests, bool per_token,
                         V1Warps warps, bool pdl, cudaStream_t stream) {
  if (params.group > 8) {  // no PV warps: that P*V layout has P as the A operand
    return per_token ? Launch<D, 16, true, false>(params, num_requests, pdl, stream)
                     : Launch<D, 16, false, false>(params, num_requests, pdl, stream);
  }
  return per_token ? LaunchNarrow<D, true>(params, num_requests, warps, pdl, stream)
                   : LaunchNarrow<D, false>(params, num_requests, warps, pdl, stream);
}

}  // namespace

cudaError_t DecodeOccupancy(int32_t head_dim, int32_t group, bool per_token_head, int* blocks) {
  *blocks = 0;
  if (head_dim != 128) return cudaErrorInvalidValue;
  const bool wide = group > 8;
  const KernelConfig& c =
      per_token_head
          ? (wide ? Configure<128, 16, true, false>() : Configure<128, 8, true, false>())
          : (wide ? Configure<128, 16, false, false>() : Configure<128, 8, false, false>());
  *blocks = c.ctas_per_sm;
  return c.error;
}

cudaError_t DecodePvWarpChoice(int32_t head_dim, int32_t group, bool per_token_head, int64_t ctas,
                               V1Warps* warps, int* pv_ctas_per_sm) {
  *warps = V1Warps::kFused;
  if (pv_ctas_per_sm != nullptr) *pv_ctas_per_sm = 0;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return cudaErrorInvalidValue;
  if (group > 8) return cudaSuccess;
  switch (head_dim) {
    case 64:
      return per_token_head ? PickPvWarp<64, true>(ctas, warps, pv_ctas_per_sm)
                            : PickPvWarp<64, false>(ctas, warps, pv_ctas_per_sm);
    case 128:
      return per_token_head ? PickPvWarp<128, true>(ctas, warps, pv_ctas_per_sm)
                            : PickPvWarp<128, false>(ctas, warps, pv_ctas_per_sm);
    default:  // 256 (checked above)
      return per_token_head ? PickPvWarp<256, true>(ctas, warps, pv_ctas_per_sm)
                            : PickPvWarp<256, false>(ctas, warps, pv_ctas_per_sm);
  }
}

cudaError_t EnqueueSparseDecode(const DecodeParams& params, int32_t head_dim, int32_t num_requests,
                                bool per_token_head, V1Warps warps, bool pdl, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return LaunchForDim<64>(params, num_requests, per_token_head, warps, pdl, stream);
    case 128:
      return LaunchForDim<128>(params, num_requests, per_token_head, warps, pdl, stream);
    case 256:
      return LaunchForDim<256>(params, num_requests, per_token_head, warps, pdl, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sds::cuda
