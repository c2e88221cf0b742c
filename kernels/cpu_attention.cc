#include "kernels/cpu_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu_attention_item.h"
#include "kernels/fp8.h"

namespace sds {
namespace {

using cpu_internal::DecodeItem;

// Per-thread scratch, grown on demand and reused across calls.
struct ItemScratch {
  std::vector<int64_t> rows;
  std::vector<float> k_scale, v_scale, scores, q_f32, acc, row_buffer, weights;
};

template <typename T>
T* Grow(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

int Log2(int power_of_two) {
  int shift = 0;
  while ((1 << shift) < power_of_two) ++shift;
  return shift;
}

// Runs work item `item` = (request b, KV head) of the batch.
void RunItem(const CacheView& cache, const DecodeBatch& batch, int64_t item, CpuKernelPath path) {
  const CacheGeometry& geo = cache.geo;
  const int num_kv_heads = geo.num_kv_heads, head_dim = geo.head_dim;
  const int group = batch.num_q_heads / num_kv_heads;
  const int b = static_cast<int>(item / num_kv_heads);
  const int kv_head = static_cast<int>(item % num_kv_heads);
  const int32_t layer = batch.layer[b];
  const int32_t topk = batch.topk[b];
  const int32_t* indices =
      batch.indices + batch.index_offset[b] +
      (batch.indices_per_kv_head[b] ? static_cast<int64_t>(kv_head) * topk : 0);
  const int32_t* pages = batch.page_table + batch.page_table_offset[b];
  const int64_t first_head = static_cast<int64_t>(b) * batch.num_q_heads + kv_head * group;
  uint16_t* out = batch.out + first_head * head_dim;
  float* lse = batch.lse ? batch.lse + first_head : nullptr;

  thread_local ItemScratch scratch;
  const size_t padded_topk = (static_cast<size_t>(topk) + 7) / 8 * 8;
  int64_t* rows = Grow(scratch.rows, padded_topk);
  float* k_scale = Grow(scratch.k_scale, padded_topk);
  float* v_scale = Grow(scratch.v_scale, padded_topk);
  const int page_shift = Log2(geo.page_size);
  const int32_t page_mask = geo.page_size - 1;
  const bool per_token_head = geo.scale_mode == ScaleMode::kPerTokenHead;
  const int64_t scale_base = static_cast<int64_t>(layer) * geo.LayerScales();
  int num_rows = 0;
  for (int32_t i = 0; i < topk; ++i) {
    const int32_t position = indices[i];
    if (position < 0) continue;
    const int64_t slot = (static_cast<int64_t>(pages[position >> page_shift]) << page_shift) +
                         (position & page_mask);
    const int64_t row = slot * num_kv_heads + kv_head;
    rows[num_rows] = row;
    k_scale[num_rows] =
        per_token_head ? cache.k_token_scale[scale_base + row] : cache.layer_k_scale[layer];
    v_scale[num_rows] =
        per_token_head ? cache.v_token_scale[scale_base + row] : cache.layer_v_scale[layer];
    ++num_rows;
  }
  if (num_rows == 0) {
    std::memset(out, 0, sizeof(uint16_t) * group * head_dim);
    if (lse) std::fill(lse, lse + group, -std::numeric_limits<float>::infinity());
    return;
  }
  // Pad to a multiple of 8 with copies of the last row (valid memory; results unused).
  const int padded_rows = (num_rows + 7) / 8 * 8;
  for (int n = num_rows; n < padded_rows; ++n) {
    rows[n] = rows[num_rows - 1];
    k_scale[n] = k_scale[num_rows - 1];
    v_scale[n] = v_scale[num_rows - 1];
  }

  DecodeItem work;
  work.group = group;
  work.head_dim = head_dim;
  work.num_rows = num_rows;
  work.inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t layer_base = static_cast<int64_t>(layer) * geo.LayerElements();
  work.k_layer = cache.k + layer_base;
  work.v_layer = cache.v + layer_base;
  work.rows = rows;
  work.k_scale = k_scale;
  work.v_scale = v_scale;
  work.q = batch.q + first_head * head_dim;
  work.gate = batch.gate + first_head * head_dim;
  work.out = out;
  work.lse = lse;
  const size_t head_elements = static_cast<size_t>(group) * head_dim;
  work.scores = Grow(scratch.scores, static_cast<size_t>(group) * padded_rows);
  work.q_f32 = Grow(scratch.q_f32, head_elements);
  work.acc = Grow(scratch.acc, head_elements);
  work.row_buffer = Grow(scratch.row_buffer, static_cast<size_t>(8) * head_dim);
  work.weights = Grow(scratch.weights, static_cast<size_t>(group) * padded_rows);
  work.bf16_scores = path == CpuKernelPath::kAvx512Bf16;
  if (path != CpuKernelPath::kPortable) {
    cpu_internal::DecodeItemAvx2(work);
  } else {
    cpu_internal::DecodeItemPortable(work);
  }
}

}  // namespace

bool CpuSupportsAvx2Path() {
#if defined(__x86_64__) || defined(__i386__)
  // F16C is CPUID leaf 1 ECX bit 29 (read directly: clang's __builtin_cpu_supports has
  // no "f16c"); avx2 also implies that the OS saves the ymm state.
  static const bool supported = [] {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  }();
  return supported;
#else
  return false;
#endif
}

bool CpuSupportsAvx512Bf16Path() {
#if defined(__x86_64__) || defined(__i386__)
  // AVX512_BF16 is CPUID leaf 7 sub-leaf 1 EAX bit 5 (read directly, as above);
  // avx512f also implies that the OS saves the zmm state.
  static const bool supported = [] {
    if (!CpuSupportsAvx2Path() || !__builtin_cpu_supports("avx512f") ||
        !__builtin_cpu_supports("avx512bw"))
      return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0 && (eax & (1u << 5)) != 0;
  }();
  return supported;
#else
  return false;
#endif
}

CpuKernelPath ResolveCpuKernelPath(CpuKernelPath requested, int head_dim) {
  if (requested == CpuKernelPath::kPortable) return requested;
  const bool avx512 = CpuSupportsAvx512Bf16Path() && head_dim % 32 == 0;
  if ((requested == CpuKernelPath::kAuto || requested == CpuKernelPath::kAvx512Bf16) && avx512)
    return CpuKernelPath::kAvx512Bf16;
  if (CpuSupportsAvx2Path() && head_dim % 16 == 0) return CpuKernelPath::kAvx2;
  return CpuKernelPath::kPortable;
}

void CpuDecode(const CacheView& cache, const DecodeBatch& batch, CpuThreadPool* pool,
               CpuKernelPath path) {
  const int64_t num_items = static_cast<int64_t>(batch.num_requests) * cache.geo.num_kv_heads;
  const CpuKernelPath resolved = ResolveCpuKernelPath(path, cache.geo.head_dim);
  auto run = [&](int64_t item) { RunItem(cache, batch, item, resolved); };
  if (pool != nullptr) {
    pool->ParallelFor(num_items, run);
  } else {
    for (int64_t item = 0; item < num_items; ++item) run(item);
  }
}

}  // namespace sds
