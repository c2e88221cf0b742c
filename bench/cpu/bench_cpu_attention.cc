// CPU decode attention against a memory read pass measured in the same run.
//
// 1. BM_ReadPass: sums a 512 MiB buffer (16x a 32 MiB LLC) with the kernels' thread
//    pool, on every core (threads:0) and on one (threads:1); its GB/s is the ceiling.
// 2. BM_CpuDecode at the seed shape scaled to this machine: Hq 32, Hkv 8, D 128,
//    top-K 512 (distinct, unsorted), page 16, batch 32, sequences of 2048 tokens on
//    randomly placed pages, four layers used round-robin so that the K/V bytes touched
//    (4 x 33.5 MB) exceed the LLC. The pool is allocated with transparent huge pages.
//    GBps counts K/V bytes read: B * Hkv * K * D * 2 (+ 8 bytes of scales per row in
//    per_token_head mode); ratio_to_read_pass = GBps / read-pass GBps at the same
//    thread count. Paths: 1 portable, 2 avx2, 3 avx512bf16 (see CpuKernelPath).
//    hot:1 runs kHotShape instead (K/V resident in L2): the compute ceiling. lists:1
//    gives each KV head its own copy of the index list (same bytes read), which turns
//    off the fused shared-index items: their effect in isolation.
//    Ceilings are the best repetition of the read and gather passes.
// 3. BM_GatherPass: the decode's number of random 128-byte rows with no arithmetic;
//    ratio_to_gather = decode GBps / gather GBps (how close to the access pattern's
//    own ceiling the kernel gets).
// 4. BM_CpuDecodeSmall: the end-to-end benchmark's "small" shape (Hq 8, Hkv 2, D 64,
//    top-K 64 shared, page 64, two layers round-robin, sequences of 640 tokens), batch
//    64 or 256, per_tensor scales, avx512bf16 path (auto), as the CPU backend runs a
//    batch: append:1 first quantises one new K/V token per request (CpuAppend on the
//    calling thread), then decodes. Here a request's K/V row is only 64 bytes, so the
//    per-item and per-request costs, not the bytes, decide; ns_per_row = core time
//    (wall x threads) per (request, KV head, token) row. gap_us:500 sleeps (untimed)
//    before each batch, as the server's cores are busy elsewhere or idle between
//    batches: caches are then cold, which back-to-back batches hide; prewake_us:150 then
//    calls Prewake 150 us before the batch, as the server does when a DecodeBatch
//    arrives, so that the pool's worker is awake (the server's case). No lse (the e2e
//    load generator asks for none). Same ratio counters as 2.
// 5. BM_PoolJob: the thread pool alone, a batch of 64 fixed 4 us items (busy waits on
//    the clock, no memory), as CpuDecode hands a small-shape batch of 64 to it. Its
//    ceiling is measured in the same run: the items run on the calling thread alone,
//    divided by the pool's thread count; ratio_to_ideal = job time / that. gap_us:500
//    sleeps (untimed) before each job, so that the workers sleep too (the server
//    between DecodeBatch calls); prewake_us:150 then calls Prewake 150 us before the
//    job, as the server does when a DecodeBatch arrives.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include <sys/mman.h>

#include "benchmark/benchmark.h"
#include "kernels/cpu_append.h"
#include "kernels/cpu_attention.h"
#include "kernels/cpu_thread_pool.h"
#include "kernels/decode_params.h"

namespace sds {
namespace {

// Heads, head dim, top-K and page size of a decode setup.
struct ModelShape {
  int num_q_heads, num_kv_heads, head_dim, topk, page_size;
};
constexpr ModelShape kSeedModel{32, 8, 128, 512, 16};
constexpr ModelShape kSmallModel{8, 2, 64, 64, 64};  // the e2e bench's "small" shape
constexpr int kHeadDim = kSeedModel.head_dim, kNumKvHeads = kSeedModel.num_kv_heads;
constexpr int kTopK = kSeedModel.topk;
// Batch, sequence length and layers of a decode setup.
// num_batches: distinct batches (index lists) cycled through, batch i on layer
// i % num_layers; 0 means one per layer.
struct DecodeShape {
  int batch, sequence_length, num_layers, num_batches = 0;
  int Batches() const { return num_batches > 0 ? num_batches : num_layers; }
};
// The seed shape scaled to this machine: 134 MB of K/V touched over four layers.
constexpr DecodeShape kSeedShape{32, 2048, 4};
// One request whose 512 tokens are all selected, one layer: 1 MB of K/V that stays in
// L2, so the time is the kernel's compute ceiling.
constexpr DecodeShape kHotShape{1, 512, 1};
// The e2e small shape's sequences: prefill 576 plus new tokens, two layers (batch 64:
// 21 MB of K/V, within the 32 MiB LLC as in the server; batch 256: 84 MB). 16 batches
// of fresh random indices are cycled, as the server sees new indices every batch
// (one batch touches 1 MB at batch 64: repeating the same two would run from L2).
constexpr int kSmallSequenceLength = 640, kSmallLayers = 2, kSmallBatches = 16;
constexpr size_t kReadBytes = size_t{512} << 20;

// Read-pass GB/s by thread count (best repetition: on a shared machine the others are
// slowed by other work); set by BM_ReadPass, which runs first.
std::map<int, double> g_read_pass_gbps;
// Random-row gather GB/s by thread count (best repetition); set by BM_GatherPass.
std::map<int, double> g_gather_pass_gbps;

// A 2 MiB-aligned host buffer with transparent huge pages requested before first touch
// (random 128-byte rows over hundreds of MB otherwise pay a TLB miss each).
template <typename T>
struct HugeBuffer {
  T* data = nullptr;
  size_t size = 0;
  explicit HugeBuffer(size_t count) : size(count) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t bytes = (count * sizeof(T) + kHuge - 1) / kHuge * kHuge;
    data = static_cast<T*>(std::aligned_alloc(kHuge, bytes));
    if (data == nullptr) std::abort();
    madvise(data, bytes, MADV_HUGEPAGE);  // advisory; ignore failure
  }
  ~HugeBuffer() { std::free(data); }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  T& operator[](size_t i) { return data[i]; }
};

// Cheap deterministic bytes for filling hundreds of MB.
struct XorShift64 {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  uint64_t Next() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  }
};

// threads == 0 means every core.
CpuThreadPool& Pool(int threads) {
  static std::map<int, std::unique_ptr<CpuThreadPool>> pools;
  std::unique_ptr<CpuThreadPool>& pool = pools[threads];
  if (!pool) pool = std::make_unique<CpuThreadPool>(threads);
  return *pool;
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Argument: threads (0 = every core).
void BM_ReadPass(benchmark::State& state) {
  CpuThreadPool& pool = Pool(static_cast<int>(state.range(0)));
  constexpr int64_t kChunks = 256;
  constexpr size_t kWords = kReadBytes / sizeof(uint64_t);
  HugeBuffer<uint64_t> buffer(kWords);
  for (size_t i = 0; i < kWords; ++i) buffer[i] = i;
  std::vector<uint64_t> chunk_sums(kChunks);
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    pool.ParallelFor(kChunks, [&](int64_t chunk) {
      const uint64_t* words = buffer.data + chunk * (kWords / kChunks);
      uint64_t lanes[8] = {};
      for (size_t i = 0; i < kWords / kChunks; i += 8)
        for (int lane = 0; lane < 8; ++lane) lanes[lane] += words[i + lane];
      chunk_sums[chunk] = std::accumulate(lanes, lanes + 8, uint64_t{0});
    });
    seconds += Seconds(std::chrono::steady_clock::now() - start);
    benchmark::DoNotOptimize(chunk_sums.data());
    benchmark::ClobberMemory();
  }
  const double gbps = static_cast<double>(kReadBytes) * state.iterations() / seconds / 1e9;
  double& best = g_read_pass_gbps[static_cast<int>(state.range(0))];
  best = std::max(best, gbps);  // the best repetition: the machine's ceiling
  state.counters["GBps"] = gbps;
  state.counters["threads"] = pool.num_threads();
}

// Argument: threads. A second ceiling: the same number of random 128-byte rows as one
// decode batch reads (B * Hkv * K * 2), gathered from the 512 MiB buffer with the same
// prefetch distance and no arithmetic. Random row gathers, not the sequential read
// pass, are what paged top-K attention can reach at best.
void BM_GatherPass(benchmark::State& state) {
  CpuThreadPool& pool = Pool(static_cast<int>(state.range(0)));
  constexpr int kRowBytes = kHeadDim, kPrefetch = 32;
  constexpr int64_t kRows = int64_t{kSeedShape.batch} * kNumKvHeads * kTopK * 2, kChunks = 256;
  HugeBuffer<uint8_t> buffer(kReadBytes);
  std::memset(buffer.data, 1, kReadBytes);
  std::vector<int64_t> offsets(kRows);
  XorShift64 bits;
  for (int64_t& offset : offsets) offset = bits.Next() % (kReadBytes / kRowBytes) * kRowBytes;
  std::vector<uint64_t> chunk_sums(kChunks);
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    pool.ParallelFor(kChunks, [&](int64_t chunk) {
      const int64_t begin = chunk * (kRows / kChunks), end = begin + kRows / kChunks;
      uint64_t lanes[kRowBytes / 8] = {};
      for (int64_t r = begin; r < end; ++r) {
        if (r + kPrefetch < end)
          for (int byte = 0; byte < kRowBytes; byte += 64)
            __builtin_prefetch(buffer.data + offsets[r + kPrefetch] + byte);
        const uint8_t* row = buffer.data + offsets[r];
        for (int lane = 0; lane < kRowBytes / 8; ++lane) {
          uint64_t word;
          std::memcpy(&word, row + 8 * lane, sizeof word);
          lanes[lane] += word;
        }
      }
      chunk_sums[chunk] = std::accumulate(std::begin(lanes), std::end(lanes), uint64_t{0});
    });
    seconds += Seconds(std::chrono::steady_clock::now() - start);
    benchmark::DoNotOptimize(chunk_sums.data());
    benchmark::ClobberMemory();
  }
  const double gbps = double{kRowBytes} * kRows * state.iterations() / seconds / 1e9;
  double& best = g_gather_pass_gbps[static_cast<int>(state.range(0))];
  best = std::max(best, gbps);
  state.counters["GBps"] = gbps;
  state.counters["threads"] = pool.num_threads();
}

// The cache (random FP8 codes, no NaN codes) and one batch per layer.
struct DecodeSetup {
  ModelShape model;
  DecodeShape shape;
  CacheGeometry geo;
  // k, v: [layers, pages, page_size, Hkv, D] FP8 codes.
  HugeBuffer<uint8_t> k, v;
  std::vector<float> k_token_scale, v_token_scale;  // [layers, pages, page_size, Hkv]
  std::vector<float> layer_k_scale, layer_v_scale;  // [layers]
  std::vector<int32_t> page_table;                  // [B, pages per sequence]
  std::vector<int64_t> page_table_offset;           // [B]
  std::vector<uint16_t> q, gate, out;               // [B, Hq, D]
  std::vector<float> lse;                           // [B, Hq]
  std::vector<int64_t> index_offset;                // [B]
  std::vector<int32_t> topk;                        // [B]
  std::vector<uint8_t> per_kv_head;                 // [B], all 0 or all 1
  std::vector<std::vector<int32_t>> indices;        // per batch: [B, K] or [B, Hkv, K]
  std::vector<std::vector<int32_t>> layer;          // per batch: [B]
  // One new token per request (append:1): k_new, v_new [B, Hkv, D] bf16; append_slot
  // [B], the slot of each sequence's last position.
  std::vector<uint16_t> k_new, v_new;
  std::vector<int64_t> append_slot;

  // per_kv_head_lists: give every KV head its own copy of the request's list (the same
  // positions, so the same bytes are read) instead of one shared list.
  DecodeSetup(ScaleMode mode, ModelShape model_in, DecodeShape shape_in, bool per_kv_head_lists)
      : model(model_in),
        shape(shape_in),
        geo{shape.num_layers,
            model.num_kv_heads,
            model.head_dim,
            model.page_size,
            int64_t{shape.batch} * (shape.sequence_length / model.page_size),
            mode},
        k(shape.num_layers * geo.LayerElements()),
        v(shape.num_layers * geo.LayerElements()) {
    std::mt19937 rng(42);
    const int kBatch = shape.batch, kNumLayers = shape.num_layers;
    const int topk_len = model.topk, kv_heads = model.num_kv_heads;
    const int q_heads = model.num_q_heads, head_dim = model.head_dim;
    const int pages_per_sequence = shape.sequence_length / model.page_size;
    XorShift64 bits;
    for (HugeBuffer<uint8_t>* codes : {&k, &v}) {
      for (size_t i = 0; i < codes->size; i += 8) {
        uint64_t word = bits.Next();
        for (int byte = 0; byte < 8; ++byte, word >>= 8) {
          const uint8_t code = static_cast<uint8_t>(word);
          (*codes)[i + byte] = (code & 0x7F) == 0x7F ? code ^ 1 : code;  // no NaN codes
        }
      }
    }
    std::uniform_real_distribution<float> scale(0.001f, 0.01f);
    k_token_scale.resize(kNumLayers * geo.LayerScales());
    v_token_scale.resize(kNumLayers * geo.LayerScales());
    for (float& s : k_token_scale) s = scale(rng);
    for (float& s : v_token_scale) s = scale(rng);
    layer_k_scale.assign(kNumLayers, 0.005f);
    layer_v_scale.assign(kNumLayers, 0.005f);

    std::vector<int32_t> pages(geo.num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);  // random page placement
    page_table = pages;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto bf16 = [](float x) {
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      return static_cast<uint16_t>(bits >> 16);
    };
    for (int b = 0; b < kBatch; ++b) {
      page_table_offset.push_back(int64_t{b} * pages_per_sequence);
      index_offset.push_back(int64_t{b} * topk_len * (per_kv_head_lists ? kv_heads : 1));
      topk.push_back(topk_len);
      per_kv_head.push_back(per_kv_head_lists ? 1 : 0);
    }
    for (size_t i = 0; i < static_cast<size_t>(kBatch) * q_heads * head_dim; ++i) {
      q.push_back(bf16(normal(rng)));
      gate.push_back(bf16(normal(rng)));
    }
    out.resize(q.size());
    lse.resize(static_cast<size_t>(kBatch) * q_heads);
    std::vector<int32_t> positions(shape.sequence_length);
    std::iota(positions.begin(), positions.end(), 0);
    for (int i = 0; i < shape.Batches(); ++i) {
      indices.emplace_back();
      for (int b = 0; b < kBatch; ++b) {
        std::shuffle(positions.begin(), positions.end(), rng);  // K distinct, unsorted
        for (int copy = 0; copy < (per_kv_head_lists ? kv_heads : 1); ++copy)
          indices[i].insert(indices[i].end(), positions.begin(), positions.begin() + topk_len);
      }
      layer.emplace_back(kBatch, i % kNumLayers);
    }
    for (size_t i = 0; i < static_cast<size_t>(kBatch) * kv_heads * head_dim; ++i) {
      k_new.push_back(bf16(normal(rng)));
      v_new.push_back(bf16(normal(rng)));
    }
    const int last = shape.sequence_length - 1;
    for (int b = 0; b < kBatch; ++b)
      append_slot.push_back(int64_t{page_table[page_table_offset[b] + last / model.page_size]} *
                                model.page_size +
                            last % model.page_size);
  }

  // The new tokens of batch i (one per request, into batch i's layer).
  AppendBatch Append(int i) {
    return AppendBatch{shape.batch, k_new.data(), v_new.data(), layer[i].data(),
                       append_slot.data()};
  }

  CacheView View() {
    CacheView view;
    view.geo = geo;
    view.k = k.data;
    view.v = v.data;
    if (geo.scale_mode == ScaleMode::kPerTokenHead) {
      view.k_token_scale = k_token_scale.data();
      view.v_token_scale = v_token_scale.data();
    } else {
      view.layer_k_scale = layer_k_scale.data();
      view.layer_v_scale = layer_v_scale.data();
    }
    return view;
  }

  // Batch i of the cycle (see DecodeShape::num_batches).
  DecodeBatch Batch(int i) {
    return DecodeBatch{shape.batch,
                       model.num_q_heads,
                       q.data(),
                       gate.data(),
                       layer[i].data(),
                       page_table.data(),
                       page_table_offset.data(),
                       indices[i].data(),
                       index_offset.data(),
                       topk.data(),
                       per_kv_head.data(),
                       out.data(),
                       lse.data()};
  }
};

// GBps of K/V bytes read (`bytes` per batch over `seconds` of all iterations), its
// ratios to the read and gather ceilings of the same run, and the time per batch.
void SetDecodeCounters(benchmark::State& state, double bytes, double seconds, int threads,
                       int pool_threads) {
  const double gbps = bytes * state.iterations() / seconds / 1e9;
  state.counters["GBps"] = gbps;
  const double read_gbps = g_read_pass_gbps.count(threads) ? g_read_pass_gbps[threads] : 0.0;
  state.counters["ratio_to_read_pass"] = read_gbps > 0 ? gbps / read_gbps : 0.0;
  const double gather_gbps = g_gather_pass_gbps.count(threads) ? g_gather_pass_gbps[threads] : 0.0;
  state.counters["ratio_to_gather"] = gather_gbps > 0 ? gbps / gather_gbps : 0.0;
  state.counters["ms_per_batch"] = seconds / state.iterations() * 1e3;
  state.counters["threads"] = pool_threads;
}

// Arguments: scale mode (0 per_tensor, 1 per_token_head), kernel path (CpuKernelPath:
// 1 portable, 2 avx2, 3 avx512bf16), threads, hot (kHotShape), lists (1: per KV head).
void BM_CpuDecode(benchmark::State& state) {
  const ScaleMode mode = state.range(0) ? ScaleMode::kPerTokenHead : ScaleMode::kPerTensor;
  const CpuKernelPath path = static_cast<CpuKernelPath>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  CpuThreadPool& pool = Pool(threads);
  if (ResolveCpuKernelPath(path, kHeadDim) != path) {
    state.SkipWithError("this CPU lacks the instructions of the requested kernel path");
    return;
  }
  const DecodeShape shape = state.range(3) ? kHotShape : kSeedShape;
  DecodeSetup setup(mode, kSeedModel, shape, state.range(4) != 0);
  const CacheView view = setup.View();
  const double rows = static_cast<double>(shape.batch) * kNumKvHeads * kTopK;
  const double bytes = rows * kHeadDim * 2 + (mode == ScaleMode::kPerTokenHead ? rows * 8 : 0);
  for (int l = 0; l < shape.num_layers; ++l) CpuDecode(view, setup.Batch(l), &pool, path);
  double seconds = 0;
  int l = 0;
  for (auto _ : state) {
    const DecodeBatch batch = setup.Batch(l);
    l = (l + 1) % shape.num_layers;
    const auto start = std::chrono::steady_clock::now();
    CpuDecode(view, batch, &pool, path);
    seconds += Seconds(std::chrono::steady_clock::now() - start);
    benchmark::DoNotOptimize(setup.out.data());
  }
  SetDecodeCounters(state, bytes, seconds, threads, pool.num_threads());
}

// Spins on the clock for `us` microseconds: an item of fixed length, no memory traffic.
void BusyFor(double us) {
  const auto start = std::chrono::steady_clock::now();
  while (Seconds(std::chrono::steady_clock::now() - start) * 1e6 < us) {
  }
}

// The server's time between batches, untimed: idle (asleep) for gap_us, of which the
// last prewake_us (<= gap_us) busy after a Prewake, as its DecodeBatch handler parses
// and stages the batch after waking the pool.
void IdleBeforeBatch(CpuThreadPool& pool, int64_t gap_us, int64_t prewake_us) {
  if (gap_us <= 0) return;
  std::this_thread::sleep_for(std::chrono::microseconds(gap_us - prewake_us));
  if (prewake_us > 0) {
    pool.Prewake(1000);
    BusyFor(static_cast<double>(prewake_us));
  }
}

// Arguments: batch, threads (0 = every core), append (1: CpuAppend of one token per
// request before each decode, as the CPU backend's Run does), gap_us (idle time before
// each batch, untimed: in the server the cores do gRPC work or sleep between batches,
// and the next batch finds its K/V rows and inputs out of L1/L2; on this VM a batch
// after 500 us idle took 1.6-2.7x its back-to-back time), prewake_us (Prewake that long
// before the batch, busy meanwhile, as the server's DecodeBatch handler does before it
// stages the batch). Small shape, per_tensor.
void BM_CpuDecodeSmall(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(1));
  const bool append = state.range(2) != 0;
  const int64_t gap_us = state.range(3);
  const int64_t prewake_us = std::min(state.range(4), gap_us);
  CpuThreadPool& pool = Pool(threads);
  const DecodeShape shape{static_cast<int>(state.range(0)), kSmallSequenceLength, kSmallLayers,
                          kSmallBatches};
  DecodeSetup setup(ScaleMode::kPerTensor, kSmallModel, shape, false);
  const CacheView view = setup.View();
  const double rows =
      static_cast<double>(shape.batch) * kSmallModel.num_kv_heads * kSmallModel.topk;
  const double bytes = rows * kSmallModel.head_dim * 2;
  for (int i = 0; i < shape.Batches(); ++i) CpuDecode(view, setup.Batch(i), &pool);
  double seconds = 0;
  int i = 0;
  for (auto _ : state) {
    DecodeBatch batch = setup.Batch(i);
    batch.lse = nullptr;  // the e2e load generator does not ask for lse
    const AppendBatch new_tokens = setup.Append(i);
    i = (i + 1) % shape.Batches();
    IdleBeforeBatch(pool, gap_us, prewake_us);
    const auto start = std::chrono::steady_clock::now();
    if (append) CpuAppend(view, new_tokens);
    CpuDecode(view, batch, &pool);
    seconds += Seconds(std::chrono::steady_clock::now() - start);
    benchmark::DoNotOptimize(setup.out.data());
  }
  SetDecodeCounters(state, bytes, seconds, threads, pool.num_threads());
  state.counters["us_per_batch"] = seconds / state.iterations() * 1e6;
  state.counters["ns_per_row"] = seconds * pool.num_threads() / state.iterations() / rows * 1e9;
}

// The small shape's kernel time with its rows in L2: one batch decoded over and over
// (no append, no gap), for changes to the per-row arithmetic that the cold cases'
// spread (10-20 % between runs on the 2-core VM) would hide. Argument: threads (0 = every
// core).
void BM_CpuDecodeSmallHot(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  CpuThreadPool& pool = Pool(threads);
  const DecodeShape shape{64, kSmallSequenceLength, kSmallLayers, 1};
  DecodeSetup setup(ScaleMode::kPerTensor, kSmallModel, shape, false);
  const CacheView view = setup.View();
  DecodeBatch batch = setup.Batch(0);
  batch.lse = nullptr;
  const double rows =
      static_cast<double>(shape.batch) * kSmallModel.num_kv_heads * kSmallModel.topk;
  CpuDecode(view, batch, &pool);
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    CpuDecode(view, batch, &pool);
    seconds += Seconds(std::chrono::steady_clock::now() - start);
    benchmark::DoNotOptimize(setup.out.data());
  }
  SetDecodeCounters(state, rows * kSmallModel.head_dim * 2, seconds, threads, pool.num_threads());
  state.counters["us_per_request"] = seconds / state.iterations() / shape.batch * 1e6;
}

// Arguments: threads (0 = every core), gap_us, prewake_us (as BM_CpuDecodeSmall's).
void BM_PoolJob(benchmark::State& state) {
  constexpr int kItems = 64;
  constexpr double kItemUs = 4.0;
  CpuThreadPool& pool = Pool(static_cast<int>(state.range(0)));
  const int64_t gap_us = state.range(1);
  const int64_t prewake_us = std::min(state.range(2), gap_us);
  // The ceiling: the same items on this thread alone (best of 20), spread over the pool.
  double serial = 1e9;
  for (int r = 0; r < 20; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int item = 0; item < kItems; ++item) BusyFor(kItemUs);
    serial = std::min(serial, Seconds(std::chrono::steady_clock::now() - start));
  }
  const double ideal = serial / pool.num_threads();
  double seconds = 0;
  for (auto _ : state) {
    IdleBeforeBatch(pool, gap_us, prewake_us);
    const auto start = std::chrono::steady_clock::now();
    pool.ParallelFor(kItems, [](int64_t) { BusyFor(kItemUs); });
    seconds += Seconds(std::chrono::steady_clock::now() - start);
  }
  const double per_job = seconds / state.iterations();
  state.counters["us_per_job"] = per_job * 1e6;
  state.counters["ideal_us"] = ideal * 1e6;
  state.counters["ratio_to_ideal"] = per_job / ideal;
  state.counters["threads"] = pool.num_threads();
}

BENCHMARK(BM_ReadPass)
    ->ArgName("threads")
    ->Arg(0)
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
BENCHMARK(BM_GatherPass)
    ->ArgName("threads")
    ->Arg(0)
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
// Every path at all cores, the fast paths on one core, then the L2-resident shape.
BENCHMARK(BM_CpuDecode)
    ->ArgNames({"token_head_scale", "path", "threads", "hot", "lists"})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx512Bf16), 0, 0, 0})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx512Bf16), 0, 0, 1})
    ->Args({1, static_cast<int>(CpuKernelPath::kAvx512Bf16), 0, 0, 0})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx2), 0, 0, 0})
    ->Args({1, static_cast<int>(CpuKernelPath::kAvx2), 0, 0, 0})
    ->Args({0, static_cast<int>(CpuKernelPath::kPortable), 0, 0, 0})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx512Bf16), 1, 0, 0})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx512Bf16), 1, 0, 1})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx2), 1, 0, 0})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx512Bf16), 1, 1, 0})
    ->Args({0, static_cast<int>(CpuKernelPath::kAvx2), 1, 1, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
// The e2e small shape: batch 64 and 256, with and without the append and an idle gap
// before each batch (with and without a prewake ahead of it), all cores and one.
BENCHMARK(BM_CpuDecodeSmall)
    ->ArgNames({"batch", "threads", "append", "gap_us", "prewake_us"})
    ->Args({64, 0, 1, 0, 0})
    ->Args({64, 0, 0, 0, 0})
    ->Args({64, 0, 1, 500, 0})
    ->Args({64, 0, 1, 500, 150})
    ->Args({256, 0, 1, 0, 0})
    ->Args({256, 0, 1, 500, 0})
    ->Args({256, 0, 1, 500, 150})
    ->Args({64, 1, 1, 0, 0})
    ->Args({256, 1, 1, 0, 0})
    ->Args({64, 1, 1, 500, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0);
BENCHMARK(BM_CpuDecodeSmallHot)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(0)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0);
BENCHMARK(BM_PoolJob)
    ->ArgNames({"threads", "gap_us", "prewake_us"})
    ->Args({0, 0, 0})
    ->Args({0, 500, 0})
    ->Args({0, 500, 150})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0);

}  // namespace
}  // namespace sds

BENCHMARK_MAIN();
