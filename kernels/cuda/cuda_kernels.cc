#include "kernels/cuda/cuda_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/decode_params_cuda.h"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cuda {

absl::Status CudaCall(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Reported here: clear the thread's last error, so that a later launch check of this
  // thread does not report it again (a sticky error stays, and is reported again).
  cudaGetLastError();
  return absl::InternalError(
      absl::StrCat(std::string(what), ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

absl::Status CheckDecodeShape(int32_t num_q_heads, const CacheGeometry& geo) {
  const int d = geo.head_dim;
  if (d != 64 && d != 128 && d != 256)
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA decode supports head_dim 64, 128 or 256, not ", d));
  if (geo.num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % geo.num_kv_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "num_q_heads ", num_q_heads, " is not a multiple of num_kv_heads ", geo.num_kv_heads));
  const int group = num_q_heads / geo.num_kv_heads;
  if (group > kDecodeMaxGroup)
    return absl::InvalidArgumentError(absl::StrCat("CUDA decode supports up to ", kDecodeMaxGroup,
                                                   " query heads per KV head, not ", group));
  if (geo.page_size <= 0 || (geo.page_size & (geo.page_size - 1)) != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("page_size ", geo.page_size, " is not a power of two"));
  if (geo.num_pages * geo.page_size * static_cast<int64_t>(geo.num_kv_heads) >
      std::numeric_limits<int32_t>::max())
    return absl::InvalidArgumentError(
        "CUDA decode needs num_pages * page_size * num_kv_heads below 2^31");
  return absl::OkStatus();
}

int32_t DecodeChunks(int32_t topk) {
  return topk > kDecodeChunkTokens ? (topk + kDecodeChunkTokens - 1) / kDecodeChunkTokens : 1;
}

static int32_t DecodeUnits(int32_t topk) {
  return topk > kDecodeUnitTokens ? (topk + kDecodeUnitTokens - 1) / kDecodeUnitTokens : 1;
}

// v2 fine-split floats of `requests` requests of `units` units each.
static int64_t V2FineFloats(int64_t requests, int32_t units, int32_t num_q_heads,
                            int32_t head_dim) {
  return requests * units * num_q_heads * (head_dim + kDecodeStatFloats);
}

int64_t DecodeWorkspaceFloats(int32_t num_requests, int32_t num_q_heads, int32_t head_dim,
                              int32_t max_topk) {
  const int32_t chunks = DecodeChunks(max_topk);
  const int64_t v1 = chunks == 1 ? 0
                                 : static_cast<int64_t>(num_requests) * chunks * num_q_heads *
                                       (head_dim + kDecodeStatFloats);
  const int32_t units = DecodeUnits(max_topk);
  if (units == 1) return v1;
  const int64_t fine_requests =
      std::min<int64_t>(num_requests, std::max(1, kDecodeV2FineMaxUnits / units));
  return std::max(v1, V2FineFloats(fine_requests, units, num_q_heads, head_dim));
}

namespace {

// SDS_DECODE_KERNEL (v1 | v2, v1 when unset), read once; kDefault when the value is bad.
DecodeKernel EnvDecodeKernel() {
  static const DecodeKernel kernel = [] {
    const char* v = std::getenv("SDS_DECODE_KERNEL");
    if (v == nullptr || *v == 0 || std::string(v) == "v1") return DecodeKernel::kV1;
    if (std::string(v) == "v2") return DecodeKernel::kV2;
    return DecodeKernel::kDefault;
  }();
  return kernel;
}

// SDS_DECODE_CLUSTER_MERGE (diagnostics): 0: v1 merges split requests through the global
// workspace only; 2: in clusters at any grid size (default, 1: only grids of at most
// one CTA per SM). Returns the value for DecodeParams::cluster_merge.
int32_t EnvClusterMerge() {
  static const int32_t mode = [] {
    const char* v = std::getenv("SDS_DECODE_CLUSTER_MERGE");
    const std::string s(v == nullptr ? "" : v);
    return s == "0" ? 0 : s == "2" ? 2 : 1;
  }();
  return mode;
}

// SDS_DECODE_PDL=0 (diagnostics): no programmatic dependent launch after the append.
bool EnvPdl() {
  static const bool enabled = [] {
    const char* v = std::getenv("SDS_DECODE_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

// SDS_DECODE_PV_WARP=0|1|2 (diagnostics): v1 without PV warps / with / with QK one step
// ahead, for G <= 8; unset or any other value: chosen per launch from the grid size.
V1Warps EnvV1Warps() {
  static const V1Warps warps = [] {
    const char* v = std::getenv("SDS_DECODE_PV_WARP");
    const std::string s(v == nullptr ? "" : v);
    return s == "2"   ? V1Warps::kPvWarpQkAhead
           : s == "1" ? V1Warps::kPvWarp
           : s == "0" ? V1Warps::kFused
                      : V1Warps::kAuto;
  }();
  return warps;
}

// v1's warps for `kernel`: forced by kV1Fused / kV1PvWarp / kV1PvWarpQkAhead, else the
// environment's (kAuto: chosen per launch).
V1Warps WarpsOf(DecodeKernel kernel) {
  if (kernel == DecodeKernel::kV1Fused) return V1Warps::kFused;
  if (kernel == DecodeKernel::kV1PvWarp) return V1Warps::kPvWarp;
  if (kernel == DecodeKernel::kV1PvWarpQkAhead) return V1Warps::kPvWarpQkAhead;
  return EnvV1Warps();
}

// SDS_DECODE_V2_HEADS (diagnostics): KV heads per v2 CTA, 0 (unset) = chosen per batch.
int32_t EnvV2Heads() {
  static const int32_t heads = [] {
    const char* v = std::getenv("SDS_DECODE_V2_HEADS");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  return heads;
}

int32_t SmCount() {
  static const int32_t sms = [] {
    int device = 0, count = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return 132;
    }
    return count;
  }();
  return sms;
}

// KV heads per v2 CTA the plan starts from: 4 measured faster than 8 on the H200 (seed
// 103 vs 110 us, 8 x 2048 48 vs 52 us: 8 warps of 190 registers fit one CTA per SM).
constexpr int32_t kV2PlanHeads = 4;

// v2 split of one launch: KV heads per CTA and coarse / fine. Only speed depends on it.
// Coarse: the widest CTA (up to kV2PlanHeads KV heads) that still gives one CTA per SM,
// never narrower than 2 heads. Fine (one CTA per 64-index unit): when even that leaves
// SMs idle and the workspace holds every unit partial. SDS_DECODE_V2_HEADS overrides
// the heads (up to kDecodeV2MaxHeads).
absl::Status PlanV2(DecodeKernel kernel, int32_t num_requests, int32_t num_q_heads,
                    const CacheGeometry& geo, int32_t max_topk, int64_t capacity_floats,
                    DecodeParams* p) {
  const int32_t hkv = geo.num_kv_heads;
  const int32_t hdiv = std::min(kDecodeV2MaxHeads, hkv & -hkv);  // largest 2^k dividing Hkv
  const int32_t hmax = std::min(kV2PlanHeads, hdiv);
  const int32_t units = DecodeUnits(max_topk);
  const int64_t sms = SmCount();
  const auto ctas = [&](int32_t h, bool fine) {
    return static_cast<int64_t>(num_requests) * (hkv / h) * (fine ? units : 1);
  };
  const bool fine_fits =
      units == 1 || V2FineFloats(num_requests, units, num_q_heads, geo.head_dim) <= capacity_floats;
  int32_t h = hmax;
  while (h > 2 && ctas(h, false) < sms) h /= 2;
  bool fine = false;
  if (kernel == DecodeKernel::kV2Fine) {
    if (!fine_fits) return absl::InternalError("decode workspace too small for the v2 fine split");
    fine = true;
  } else if (kernel == DecodeKernel::kV2) {
    fine = units > 1 && fine_fits && ctas(h, false) < sms &&
           static_cast<int64_t>(num_requests) * units <= kDecodeV2FineMaxUnits;
  }
  if (fine) {
    h = hmax;
    while (h > 2 && ctas(h, true) < sms) h /= 2;
  }
  const int32_t forced = EnvV2Heads();
  if (forced > 0 && forced <= hdiv && (forced & (forced - 1)) == 0) h = forced;
  p->heads_per_cta = h;
  p->fine = fine ? 1 : 0;
  p->max_units = units;
  return absl::OkStatus();
}

}  // namespace

int32_t DecodeMaxTopK() { return kDecodeMaxChunks * kDecodeChunkTokens; }

int64_t DecodeWorkspaceCounters(int32_t num_requests, int32_t num_kv_heads) {
  return static_cast<int64_t>(num_requests) * num_kv_heads;
}

int32_t DecodeInlineRequests() { return kDecodeInlineRequests; }

absl::Status LaunchDecode(const CacheView& cache, const DecodeBatch& batch, int32_t max_topk,
                          const DecodeWorkspace& workspace, cudaStream_t stream,
                          DecodeKernel kernel, const DecodeBatch* host_batch, bool after_append) {
  if (batch.num_requests <= 0) return absl::OkStatus();
  const CacheGeometry& geo = cache.geo;
  if (absl::Status s = CheckDecodeShape(batch.num_q_heads, geo); !s.ok()) return s;
  if (kernel == DecodeKernel::kDefault) kernel = EnvDecodeKernel();
  if (kernel == DecodeKernel::kDefault)
    return absl::InvalidArgumentError("SDS_DECODE_KERNEL must be v1 or v2 (or unset for v1)");
  const bool v2 = kernel == DecodeKernel::kV2 || kernel == DecodeKernel::kV2Coarse ||
                  kernel == DecodeKernel::kV2Fine;
  // The kernels read gate and write out 8 bytes at a time, q 8 (v1) or 16 (v2), and the
  // split-K partials 16: a misaligned pointer would fault (and take the CUDA context
  // with it).
  if (reinterpret_cast<uintptr_t>(batch.q) % (v2 ? 16 : 8) != 0 ||
      reinterpret_cast<uintptr_t>(batch.gate) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(batch.out) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(workspace.partial) % 16 != 0)
    return absl::InvalidArgumentError(
        "CUDA decode needs q (16 for v2), gate and out 8-byte aligned and the workspace "
        "16-byte aligned");
  const bool per_token = geo.scale_mode == ScaleMode::kPerTokenHead;
  const int32_t chunks = DecodeChunks(max_topk);
  const int64_t need_floats =
      DecodeWorkspaceFloats(batch.num_requests, batch.num_q_heads, geo.head_dim, max_topk);
  const int64_t need_counters = DecodeWorkspaceCounters(batch.num_requests, geo.num_kv_heads);
  if (!v2 && (need_floats > workspace.capacity_floats ||
              (chunks > 1 && need_counters > workspace.capacity_counters)))
    return absl::InternalError(absl::StrCat(
        "decode workspace too small: needs ", need_floats, " floats and ", need_counters,
        " counters, has ", workspace.capacity_floats, " and ", workspace.capacity_counters));
  if (batch.num_requests > 65535 || chunks > kDecodeMaxChunks)
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA decode: at most 65535 requests per launch and ",
                     kDecodeMaxChunks * kDecodeChunkTokens, " indices per request"));

  DecodeParams p{};
  p.k = cache.k;
  p.v = cache.v;
  p.k_token_scale = cache.k_token_scale;
  p.v_token_scale = cache.v_token_scale;
  p.layer_k_scale = cache.layer_k_scale;
  p.layer_v_scale = cache.layer_v_scale;
  p.layer_elements = geo.LayerElements();
  p.layer_scales = geo.LayerScales();
  p.num_kv_heads = geo.num_kv_heads;
  p.page_size = geo.page_size;
  p.page_shift = 0;
  while ((1 << p.page_shift) < geo.page_size) ++p.page_shift;
  p.num_q_heads = batch.num_q_heads;
  p.group = batch.num_q_heads / geo.num_kv_heads;
  p.q = batch.q;
  p.gate = batch.gate;
  p.layer = batch.layer;
  p.page_table = batch.page_table;
  p.page_table_offset = batch.page_table_offset;
  p.indices = batch.indices;
  p.index_offset = batch.index_offset;
  p.topk = batch.topk;
  p.indices_per_kv_head = batch.indices_per_kv_head;
  p.out = batch.out;
  p.lse = batch.lse;
  p.partial_o = workspace.partial;
  p.partial_stats = workspace.partial == nullptr
                        ? nullptr
                        : workspace.partial + static_cast<int64_t>(batch.num_requests) * chunks *
                                                  batch.num_q_heads * geo.head_dim;
  p.counters = workspace.counters;
  p.max_chunks = chunks;
  p.score_scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(geo.head_dim));
  p.cluster_merge = kernel != DecodeKernel::kV1GlobalMerge ? EnvClusterMerge() : 0;
  if (host_batch != nullptr && host_batch->num_requests != batch.num_requests)
    return absl::InternalError(absl::StrCat("decode host copies describe ",
                                            host_batch->num_requests, " requests, the batch ",
                                            batch.num_requests));
  if (!v2 && host_batch != nullptr && batch.num_requests <= kDecodeInlineRequests) {
    p.inline_requests = 1;
    for (int32_t b = 0; b < batch.num_requests; ++b)
      p.req[b] = DecodeRequestScalars{
          host_batch->index_offset[b], host_batch->page_table_offset[b],   host_batch->topk[b],
          host_batch->layer[b],        host_batch->indices_per_kv_head[b], 0};
  }
  if (!v2)
    return CudaCall(EnqueueSparseDecode(p, geo.head_dim, batch.num_requests, per_token,
                                        WarpsOf(kernel), after_append && EnvPdl(), stream),
                    "sparse decode kernel launch");
  if (absl::Status s = PlanV2(kernel, batch.num_requests, batch.num_q_heads, geo, max_topk,
                              workspace.partial == nullptr ? 0 : workspace.capacity_floats, &p);
      !s.ok())
    return s;
  if (p.fine)  // unit partials [B, Hkv, max_units, G, D], then their stats
    p.partial_stats = workspace.partial + static_cast<int64_t>(batch.num_requests) * p.max_units *
                                              batch.num_q_heads * geo.head_dim;
  return CudaCall(EnqueueSparseDecodeV2(p, geo.head_dim, batch.num_requests, per_token, stream),
                  "sparse decode v2 kernel launch");
}

absl::Status LaunchAppend(const CacheView& cache, const AppendBatch& append, cudaStream_t stream) {
  if (append.num_tokens <= 0) return absl::OkStatus();
  const int d = cache.geo.head_dim;
  if (d != 64 && d != 128 && d != 256)
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA append supports head_dim 64, 128 or 256, not ", d));
  return CudaCall(EnqueueAppend(cache, append, stream), "append kernel launch");
}

}  // namespace sds::cuda
