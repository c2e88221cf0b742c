#include "kernels/cpu_attention.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
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
  std::vector<int64_t> rows;  // base rows (slot * Hkv) of the current index list
  // RunRequests: base rows of the current and the next request.
  std::vector<int64_t> pipelined_rows[2];
  std::vector<float> k_scale, v_scale, scores, q_f32, acc, row_buffer, weights;
};

ItemScratch& ThreadScratch() {
  thread_local ItemScratch scratch;
  return scratch;
}

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

// The KV heads of one work item: a block of `num_heads` consecutive KV heads of
// request b, starting at `first_head`.
struct HeadBlock {
  int b = 0, first_head = 0, num_heads = 1;
};

// Fills `rows` with the base row (slot * Hkv, head 0) of every valid index of `indices`
// [topk], in index order, padded to a multiple of 8 with the last row. Returns N.
int GatherBaseRows(const CacheGeometry& geo, const int32_t* pages, const int32_t* indices,
                   int32_t topk, int64_t* rows) {
  const int page_shift = Log2(geo.page_size);
  const int32_t page_mask = geo.page_size - 1;
  int num_rows = 0;
  for (int32_t i = 0; i < topk; ++i) {
    const int32_t position = indices[i];
    if (position < 0) continue;
    const int64_t slot = (static_cast<int64_t>(pages[position >> page_shift]) << page_shift) +
                         (position & page_mask);
    rows[num_rows++] = slot * geo.num_kv_heads;
  }
  if (num_rows == 0) return 0;
  const int padded_rows = (num_rows + 7) / 8 * 8;
  for (int n = num_rows; n < padded_rows; ++n) rows[n] = rows[num_rows - 1];
  return num_rows;
}

// Runs KV head `kv_head` of request b over the base rows `rows` [N rounded up to 8].
void RunHead(const CacheView& cache, const DecodeBatch& batch, int b, int kv_head,
             const int64_t* rows, int num_rows, CpuKernelPath path, ItemScratch& scratch) {
  const CacheGeometry& geo = cache.geo;
  const int num_kv_heads = geo.num_kv_heads, head_dim = geo.head_dim;
  const int group = batch.num_q_heads / num_kv_heads;
  const int32_t layer = batch.layer[b];
  const int64_t first_head = static_cast<int64_t>(b) * batch.num_q_heads + kv_head * group;
  uint16_t* out = batch.out + first_head * head_dim;
  float* lse = batch.lse ? batch.lse + first_head : nullptr;
  if (num_rows == 0) {
    std::memset(out, 0, sizeof(uint16_t) * group * head_dim);
    if (lse) std::fill(lse, lse + group, -std::numeric_limits<float>::infinity());
    return;
  }
  const int padded_rows = (num_rows + 7) / 8 * 8;
  float* k_scale = Grow(scratch.k_scale, padded_rows);
  float* v_scale = Grow(scratch.v_scale, padded_rows);
  if (geo.scale_mode == ScaleMode::kPerTokenHead) {
    const float* k_token = cache.k_token_scale + static_cast<int64_t>(layer) * geo.LayerScales();
    const float* v_token = cache.v_token_scale + static_cast<int64_t>(layer) * geo.LayerScales();
    for (int n = 0; n < padded_rows; ++n) {
      k_scale[n] = k_token[rows[n] + kv_head];
      v_scale[n] = v_token[rows[n] + kv_head];
    }
  } else {
    std::fill(k_scale, k_scale + padded_rows, cache.layer_k_scale[layer]);
    std::fill(v_scale, v_scale + padded_rows, cache.layer_v_scale[layer]);
  }

  DecodeItem work;
  work.group = group;
  work.head_dim = head_dim;
  work.num_rows = num_rows;
  work.prefetch_rows = cpu_internal::kPrefetchRows;
  work.inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(head_dim));
  // Row r of this head is at k_layer + r * D with r = base row; the head's offset within
  // the token slot is folded into the layer pointers.
  const int64_t layer_base = static_cast<int64_t>(layer) * geo.LayerElements();
  work.k_layer = cache.k + layer_base + static_cast<int64_t>(kv_head) * head_dim;
  work.v_layer = cache.v + layer_base + static_cast<int64_t>(kv_head) * head_dim;
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
  if (work.bf16_scores && cpu_internal::FusedItemSupported(group, head_dim)) {
    // A fused item of one KV head: same bits as that head inside a larger fused item,
    // and faster out of cache than DecodeItemAvx2 (9.5 vs 13 ms per batch, lists:1, one
    // thread), whose fp16-trick score pass it replaces.
    work.prefetch_rows = cpu_internal::FusedPrefetchRows(1);
    cpu_internal::DecodeItemFusedAvx512(work);
  } else if (path != CpuKernelPath::kPortable) {
    cpu_internal::DecodeItemAvx2(work);
  } else {
    cpu_internal::DecodeItemPortable(work);
  }
}

// The fused item that runs next on this thread, for its K and V rows to be prefetched:
// request b and its base rows [num_rows] (num_rows == 0: none).
struct NextFused {
  int b = 0;
  const int64_t* rows = nullptr;
  int num_rows = 0;
};

// What RunFusedBlock tells the next item of its thread: whether its K and V rows were
// prefetched already.
struct FusedHandOff {
  bool rows_prefetched = false;
};

// Items whose V bytes are at most this prefetch their V rows during the score pass
// (then K + V stay in L2 between the passes; the e2e small shape's item has 8 KiB).
constexpr int64_t kEarlyValueBytes = 64 * 1024;

// Runs the KV heads of `block` as one fused item over the shared base rows `rows`
// [N rounded up to 8], N >= 1: each token slot's K (and V) bytes of all the block's
// heads are read together. Same output bits as RunHead for each head. `next`: the
// fused item this thread runs next (same heads), or num_rows == 0.
// Returns what the next item may skip.
FusedHandOff RunFusedBlock(const CacheView& cache, const DecodeBatch& batch, const HeadBlock& block,
                           const int64_t* rows, int num_rows, const NextFused& next,
                           const FusedHandOff& previous, ItemScratch& scratch) {
  const CacheGeometry& geo = cache.geo;
  const int head_dim = geo.head_dim, group = batch.num_q_heads / geo.num_kv_heads;
  const int kv_heads = block.num_heads;
  const int32_t layer = batch.layer[block.b];
  const int padded_rows = (num_rows + 7) / 8 * 8;
  const size_t scale_count = static_cast<size_t>(kv_heads) * padded_rows;
  float* k_scale = Grow(scratch.k_scale, scale_count);  // [H, padded_rows]
  float* v_scale = Grow(scratch.v_scale, scale_count);
  if (geo.scale_mode == ScaleMode::kPerTokenHead) {
    const float* k_token = cache.k_token_scale + static_cast<int64_t>(layer) * geo.LayerScales();
    const float* v_token = cache.v_token_scale + static_cast<int64_t>(layer) * geo.LayerScales();
    for (int i = 0; i < kv_heads; ++i)
      for (int n = 0; n < padded_rows; ++n) {
        k_scale[i * padded_rows + n] = k_token[rows[n] + block.first_head + i];
        v_scale[i * padded_rows + n] = v_token[rows[n] + block.first_head + i];
      }
  } else {
    std::fill(k_scale, k_scale + scale_count, cache.layer_k_scale[layer]);
    std::fill(v_scale, v_scale + scale_count, cache.layer_v_scale[layer]);
  }
  const int64_t first_head =
      static_cast<int64_t>(block.b) * batch.num_q_heads + block.first_head * group;
  DecodeItem work;
  work.group = group;
  work.kv_heads = kv_heads;
  work.head_dim = head_dim;
  work.num_rows = num_rows;
  work.prefetch_rows = cpu_internal::FusedPrefetchRows(kv_heads);
  work.inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t layer_base = static_cast<int64_t>(layer) * geo.LayerElements();
  work.k_layer = cache.k + layer_base + static_cast<int64_t>(block.first_head) * head_dim;
  work.v_layer = cache.v + layer_base + static_cast<int64_t>(block.first_head) * head_dim;
  work.rows = rows;
  work.k_scale = k_scale;
  work.v_scale = v_scale;
  work.q = batch.q + first_head * head_dim;
  work.gate = batch.gate + first_head * head_dim;
  work.out = batch.out + first_head * head_dim;
  work.lse = batch.lse ? batch.lse + first_head : nullptr;
  const size_t heads = static_cast<size_t>(kv_heads) * group;
  work.scores = Grow(scratch.scores, heads * padded_rows);
  work.q_f32 = Grow(scratch.q_f32, heads * head_dim);
  work.acc = Grow(scratch.acc, heads * head_dim);
  work.weights = Grow(scratch.weights, heads * padded_rows);
  work.bf16_scores = true;
  work.prefetch_values_early =
      static_cast<int64_t>(num_rows) * kv_heads * head_dim <= kEarlyValueBytes;
  work.rows_prefetched = previous.rows_prefetched;
  // The next item's rows are prefetched a whole item ahead when both items are small.
  FusedHandOff hand_off;
  if (work.prefetch_values_early && next.num_rows > 0 &&
      static_cast<int64_t>(next.num_rows) * kv_heads * head_dim <= kEarlyValueBytes) {
    const int64_t next_base = static_cast<int64_t>(batch.layer[next.b]) * geo.LayerElements() +
                              static_cast<int64_t>(block.first_head) * head_dim;
    work.next_k_layer = cache.k + next_base;
    work.next_v_layer = cache.v + next_base;
    work.next_rows = next.rows;
    work.next_num_rows = next.num_rows;
    hand_off.rows_prefetched = true;
  }
  cpu_internal::DecodeItemFusedAvx512(work);
  return hand_off;
}

// Runs one work item: the KV heads of `block`. When request b's indices are shared by
// all KV heads the row list is built once, and on the kAvx512Bf16 path (where the shape
// allows) the heads run as one fused item that reads each token slot once. (Running the
// heads one by one with the first head prefetching each slot's whole span, for the
// others to find in cache, measured 40% slower out of cache: the request's 1 MiB of K/V
// does not stay in L2, and the wide prefetch bursts stall the first head.)
void RunBlock(const CacheView& cache, const DecodeBatch& batch, const HeadBlock& block,
              CpuKernelPath path) {
  ItemScratch& scratch = ThreadScratch();
  const int32_t topk = batch.topk[block.b];
  const int32_t* indices = batch.indices + batch.index_offset[block.b];
  const int32_t* pages = batch.page_table + batch.page_table_offset[block.b];
  int64_t* rows = Grow(scratch.rows, (static_cast<size_t>(topk) + 7) / 8 * 8);
  const int head_dim = cache.geo.head_dim;
  if (!batch.indices_per_kv_head[block.b]) {
    const int num_rows = GatherBaseRows(cache.geo, pages, indices, topk, rows);
    const int group = batch.num_q_heads / cache.geo.num_kv_heads;
    if (num_rows > 0 && path == CpuKernelPath::kAvx512Bf16 &&
        cpu_internal::FusedItemSupported(group, head_dim)) {
      RunFusedBlock(cache, batch, block, rows, num_rows, NextFused{}, FusedHandOff{}, scratch);
      return;
    }
    for (int i = 0; i < block.num_heads; ++i)
      RunHead(cache, batch, block.b, block.first_head + i, rows, num_rows, path, scratch);
    return;
  }
  for (int i = 0; i < block.num_heads; ++i) {
    const int kv_head = block.first_head + i;
    const int num_rows = GatherBaseRows(cache.geo, pages,
                                        indices + static_cast<int64_t>(kv_head) * topk, topk, rows);
    RunHead(cache, batch, block.b, kv_head, rows, num_rows, path, scratch);
  }
}

// Runs whole requests (all KV heads) one after another on this thread, each taken from
// `claim` (a request index, or -1 when none is left). The next request is claimed, and
// its rows gathered, before the current one runs, so that where both run as fused items
// (shared indices, kAvx512Bf16, shape supported) the current item prefetches the next
// one's K/V rows; other requests go through RunBlock. Which thread runs which request
// never changes an output bit.
template <typename Claim>
void RunRequests(const CacheView& cache, const DecodeBatch& batch, Claim& claim,
                 CpuKernelPath path) {
  ItemScratch& scratch = ThreadScratch();
  const CacheGeometry& geo = cache.geo;
  const int group = batch.num_q_heads / geo.num_kv_heads;
  const bool fusable =
      path == CpuKernelPath::kAvx512Bf16 && cpu_internal::FusedItemSupported(group, geo.head_dim);
  // Gathers request b's rows into pipelined_rows[slot]; returns N, or 0 when b does not
  // run as a fused item (no valid index, per-KV-head lists, or not fusable).
  auto gather = [&](int b, int slot) {
    if (!fusable || batch.indices_per_kv_head[b]) return 0;
    const int32_t topk = batch.topk[b];
    int64_t* rows = Grow(scratch.pipelined_rows[slot], (static_cast<size_t>(topk) + 7) / 8 * 8);
    return GatherBaseRows(geo, batch.page_table + batch.page_table_offset[b],
                          batch.indices + batch.index_offset[b], topk, rows);
  };
  int b = claim();
  if (b < 0) return;
  int slot = 0;  // pipelined_rows[slot] holds b's rows, the other slot the next's
  int num_rows = gather(b, slot);
  FusedHandOff hand_off;
  while (b >= 0) {
    NextFused next;
    next.b = claim();
    if (next.b >= 0) {
      next.num_rows = gather(next.b, slot ^ 1);
      next.rows = scratch.pipelined_rows[slot ^ 1].data();
    }
    const HeadBlock block{b, 0, geo.num_kv_heads};
    if (num_rows > 0) {
      hand_off = RunFusedBlock(cache, batch, block, scratch.pipelined_rows[slot].data(), num_rows,
                               next, hand_off, scratch);
    } else {
      RunBlock(cache, batch, block, path);
      hand_off = FusedHandOff{};
    }
    b = next.b;
    num_rows = next.num_rows;
    slot ^= 1;
  }
}

// KV heads per work item: all of them when the batch alone gives every thread several
// items, fewer (halving) otherwise. Each head's arithmetic is the same whatever block
// it lands in, so this choice (which depends on the batch) never changes an output bit.
int HeadsPerItem(int num_requests, int num_kv_heads, int num_threads) {
  int heads = num_kv_heads;
  while (heads % 2 == 0 &&
         static_cast<int64_t>(num_requests) * (num_kv_heads / heads) < 4 * num_threads)
    heads /= 2;
  return heads;
}

// Below this many gathered K/V rows (token slot x KV head; about 50 ns each out of
// cache) a batch runs on the calling thread: waking a pool worker costs a few
// microseconds on each side, more than it saves, and on a machine whose cores are busy
// with other work (the server's gRPC threads, its clients) it costs a context switch.
constexpr int64_t kMinRowsForPool = 1024;

bool SmallBatch(const DecodeBatch& batch, int num_kv_heads) {
  int64_t rows = 0;
  for (int b = 0; b < batch.num_requests && rows < kMinRowsForPool; ++b)
    rows += static_cast<int64_t>(batch.topk[b]) * num_kv_heads;
  return rows < kMinRowsForPool;
}

}  // namespace

int64_t CpuDecodeMinPooledRows() { return kMinRowsForPool; }

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
  const int num_kv_heads = cache.geo.num_kv_heads;
  const int num_threads = pool ? pool->num_threads() : 1;
  const int heads_per_item = HeadsPerItem(batch.num_requests, num_kv_heads, num_threads);
  const CpuKernelPath resolved = ResolveCpuKernelPath(path, cache.geo.head_dim);
  const bool pooled = pool != nullptr && !SmallBatch(batch, num_kv_heads);
  if (heads_per_item == num_kv_heads) {
    // Whole requests, claimed one at a time by each taking thread (one pool item per
    // thread: a thread that is slow to wake finds the requests taken and returns).
    std::atomic<int> next_request{0};
    auto claim = [&] {
      const int b = next_request.fetch_add(1, std::memory_order_relaxed);
      return b < batch.num_requests ? b : -1;
    };
    if (pooled) {
      pool->ParallelFor(num_threads, [&](int64_t) { RunRequests(cache, batch, claim, resolved); });
    } else {
      RunRequests(cache, batch, claim, resolved);
    }
    return;
  }
  const int blocks_per_request = num_kv_heads / heads_per_item;
  const int64_t num_items = static_cast<int64_t>(batch.num_requests) * blocks_per_request;
  auto run = [&](int64_t item) {
    HeadBlock block;
    block.b = static_cast<int>(item / blocks_per_request);
    block.first_head = static_cast<int>(item % blocks_per_request) * heads_per_item;
    block.num_heads = heads_per_item;
    RunBlock(cache, batch, block, resolved);
  };
  if (pooled) {
    pool->ParallelFor(num_items, run);
  } else {
    for (int64_t item = 0; item < num_items; ++item) run(item);
  }
}

}  // namespace sds
