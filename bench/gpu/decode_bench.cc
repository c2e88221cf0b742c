// GPU benchmark of the sparse decode and append kernels. Measures a device read pass
// in the same process, then for each case the median kernel time of the v1 and the v2
// decode kernels on the same inputs (CUDA events, warm-up, L2 flushed before every
// timed launch) and its ratio to the floor (minimum bytes / read-pass bandwidth), and
// the largest v1 - v2 output difference. Prints a table; exits non-zero on any error.
//   decode_bench [--case NAME] [--iters N] [--flush memset|read] [--inputs cold|warm]
//                [--host_scalars on|off] [--order random|chunk] [--pdl on|off]
// --case backend (or one backend_* case): the CUDA backend's Run per batch, outputs
// copied back vs written into the mapped staging (backend_bench.cc), only when named.
// --flush: how L2 is emptied before each timed launch: `memset` (default, the method of
// the first table) writes 256 MiB, which leaves ~50 MB of dirty lines in L2 that the
// timed kernel then pays to write back; `read` reads a separate 256 MiB buffer instead,
// leaving L2 full of clean, unrelated lines (a cold cache without the write-back debt).
// --inputs warm: the batch's inputs are copied to the device again after the flush (as
// the server copies them before each launch), so only the K/V cache starts cold.
// --host_scalars on (default, as the CUDA backend): the decode launches also get the host
// copies of the per-request scalars (v1 takes them from its parameters for batches of at
// most 16); off: the kernel reads them from global memory.
// --order chunk (diagnostic): every index list (each KV head's, for per-KV-head lists) is
// sorted by position within each decode chunk (kDecodeChunkTokens indices, -1 last), what
// an in-kernel per-chunk sort would feed the gathers; random (default): the lists in the
// random (score-like) order they were drawn in. Same positions either way.
// --pdl on (default, as the CUDA backend): the `ad_` cases (an append of each request's
// new token, then the decode, timed together) launch the v1 decode with programmatic
// dependent launch; off: a plain launch after the append.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/gpu/bench_kernels.h"
#ifdef SDS_BENCH_BACKEND
#include "bench/gpu/backend_bench.h"
#endif
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cudabench {
namespace {

bool g_failed = false;

void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(err));
  std::exit(2);
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  Check(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}

template <typename T>
T* UploadVec(const std::vector<T>& v) {
  T* p = static_cast<T*>(Alloc(v.size() * sizeof(T) + 16));
  Check(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return p;
}

struct Flusher {
  void* buf = nullptr;               // [bytes] bytes
  void* sink = nullptr;              // [132 * 8 * 512] uint32 (read mode)
  size_t bytes = size_t{256} << 20;  // 256 MiB > 50 MB L2
  bool read = false;
  explicit Flusher(bool read_mode) : read(read_mode) {
    buf = Alloc(bytes);
    sink = Alloc(132 * 8 * 512 * 4);
    Check(cudaMemset(buf, 1, bytes), "flush fill");
  }
  ~Flusher() {
    cudaFree(buf);
    cudaFree(sink);
  }
  void Run(cudaStream_t s) {
    if (read) {
      Check(ReadPass(buf, static_cast<int64_t>(bytes), static_cast<uint32_t*>(sink), 132 * 8, s),
            "flush read");
    } else {
      Check(cudaMemsetAsync(buf, 0, bytes, s), "flush");
    }
  }
};

// Median of `iters` timed runs of fn (L2 flushed before each, then `after_flush`, both
// outside the timed span), in microseconds.
template <typename Fn>
double TimeMedianUs(Fn fn, int iters, Flusher* flush, cudaStream_t s,
                    const std::function<void()>& after_flush = {}) {
  cudaEvent_t a, b;
  Check(cudaEventCreate(&a), "event");
  Check(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) fn();
  Check(cudaStreamSynchronize(s), "warm-up");
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    if (flush) flush->Run(s);
    if (after_flush) after_flush();
    Check(cudaEventRecord(a, s), "record");
    fn();
    Check(cudaEventRecord(b, s), "record");
    Check(cudaEventSynchronize(b), "sync");
    float t = 0;
    Check(cudaEventElapsedTime(&t, a, b), "elapsed");
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] * 1000.0;
}

double ReadPassGBs(cudaStream_t s) {
  const int64_t bytes = int64_t{4} << 30;
  void* data = Alloc(bytes);
  Check(cudaMemsetAsync(data, 1, bytes, s), "fill");
  uint32_t* sink = static_cast<uint32_t*>(Alloc(132 * 8 * 512 * 4));
  const double us = TimeMedianUs(
      [&] { Check(ReadPass(data, bytes, sink, 132 * 8, s), "read pass"); }, 10, nullptr, s);
  cudaFree(data);
  cudaFree(sink);
  return bytes / (us * 1e3);
}

struct Case {
  std::string name;
  int batch, hq, hkv, d, page;
  int64_t seq_len;
  int topk;
  ScaleMode mode;
  double goal_ratio;    // goal on time / floor (0: none)
  double goal_us;       // goal on absolute time (0: none)
  bool sorted = false;  // each list in position order (diagnostic of access locality)
  bool append = false;  // time an append of each request's new token before the decode
};

// --inputs warm: after the flush, copy the batch's inputs (q, gate, indices, page tables,
// offsets) to the device again, as the server does right before each launch, so they are
// in L2 and only the K/V cache is cold. Default (cold): every input is flushed too.
bool g_warm_inputs = false;
bool g_host_scalars = true;  // --host_scalars
bool g_chunk_order = false;  // --order chunk
bool g_pdl = true;           // --pdl

// Sorts each kDecodeChunkTokens-index chunk of `list` by position, -1 entries last.
void SortWithinChunks(std::vector<int32_t>& list) {
  for (size_t c = 0; c < list.size(); c += cuda::kDecodeChunkTokens) {
    const size_t end = std::min(list.size(), c + cuda::kDecodeChunkTokens);
    std::sort(list.begin() + c, list.begin() + end, [](int32_t a, int32_t b) {
      return static_cast<uint32_t>(a) < static_cast<uint32_t>(b);  // -1 as the largest
    });
  }
}

template <typename T>
void Reupload(T* device, const std::vector<T>& host, cudaStream_t s) {
  Check(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, s),
        "re-upload input");
}

struct Result {
  double us = 0, us_v2 = 0, floor_us = 0, min_bytes = 0;
  double max_diff = 0, max_abs = 0;  // largest |v1 - v2| and |v1| over the outputs
};

float Bf16ToFloat(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Random-row gather bandwidth (GB/s) over a `region` byte buffer with rows of row_bytes.
double GatherGBs(int64_t region, int row_bytes, cudaStream_t s) {
  void* data = Alloc(region);
  Check(cudaMemsetAsync(data, 1, region, s), "fill");
  const int64_t n_rows = region / row_bytes;
  std::vector<int32_t> ids(n_rows);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
  int32_t* dids = UploadVec(ids);
  uint32_t* sink = static_cast<uint32_t*>(Alloc(132 * 8 * 512 * 4));
  Flusher flush(false);
  const double us = TimeMedianUs(
      [&] { Check(Gather(data, dids, n_rows, row_bytes, sink, 132 * 8, s), "gather"); }, 10, &flush,
      s);
  cudaFree(data);
  cudaFree(dids);
  cudaFree(sink);
  return region / (us * 1e3);
}

Result RunDecodeCase(const Case& c, double read_gbs, int iters, Flusher* flush, cudaStream_t s) {
  std::mt19937 rng(42);
  const int64_t pages_per_seq = (c.seq_len + c.page - 1) / c.page;
  CacheGeometry geo;
  geo.num_layers = 1;
  geo.num_kv_heads = c.hkv;
  geo.head_dim = c.d;
  geo.page_size = c.page;
  geo.num_pages = pages_per_seq * c.batch;
  geo.scale_mode = c.mode;
  const int64_t elems = geo.LayerElements();
  CacheView view;
  view.geo = geo;
  view.k = static_cast<uint8_t*>(Alloc(elems));
  view.v = static_cast<uint8_t*>(Alloc(elems));
  Check(FillFp8(view.k, elems, 1, s), "fill k");
  Check(FillFp8(view.v, elems, 2, s), "fill v");
  std::vector<float> layer_scale = {0.05f};
  float* dls = UploadVec(layer_scale);
  float *kts = nullptr, *vts = nullptr;
  if (c.mode == ScaleMode::kPerTokenHead) {
    std::vector<float> ts(geo.LayerScales());
    std::uniform_real_distribution<float> u(0.01f, 0.1f);
    for (auto& x : ts) x = u(rng);
    kts = UploadVec(ts);
    vts = UploadVec(ts);
    view.k_token_scale = kts;
    view.v_token_scale = vts;
  } else {
    view.layer_k_scale = dls;
    view.layer_v_scale = dls;
  }
  // Page tables: a random permutation of all pages. Indices: K distinct positions.
  std::vector<int32_t> perm(geo.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int64_t> pto(c.batch), io(c.batch);
  std::vector<int32_t> topk(c.batch, c.topk), layer(c.batch, 0), indices;
  std::vector<uint8_t> perkv(c.batch, 0);
  for (int b = 0; b < c.batch; ++b) {
    pto[b] = b * pages_per_seq;
    io[b] = static_cast<int64_t>(b) * c.topk;
    std::vector<int32_t> list;
    if (c.topk >= c.seq_len) {
      list.resize(c.seq_len);
      std::iota(list.begin(), list.end(), 0);
      std::shuffle(list.begin(), list.end(), rng);
      if (c.sorted) std::sort(list.begin(), list.end());
      list.resize(c.topk, -1);
    } else {
      std::vector<char> used(c.seq_len, 0);
      std::uniform_int_distribution<int64_t> pos(0, c.seq_len - 1);
      while (static_cast<int>(list.size()) < c.topk) {
        const int64_t t = pos(rng);
        if (!used[t]) used[t] = 1, list.push_back(static_cast<int32_t>(t));
      }
      if (c.sorted) std::sort(list.begin(), list.end());
    }
    if (g_chunk_order) SortWithinChunks(list);
    indices.insert(indices.end(), list.begin(), list.end());
  }
  const size_t qn = static_cast<size_t>(c.batch) * c.hq * c.d;
  std::vector<uint16_t> q(qn), gate(qn);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < qn; ++i) q[i] = Bf16(nd(rng)), gate[i] = Bf16(nd(rng));
  DecodeBatch batch;
  batch.num_requests = c.batch;
  batch.num_q_heads = c.hq;
  batch.q = UploadVec(q);
  batch.gate = UploadVec(gate);
  batch.layer = UploadVec(layer);
  batch.page_table = UploadVec(perm);
  batch.page_table_offset = UploadVec(pto);
  batch.indices = UploadVec(indices);
  batch.index_offset = UploadVec(io);
  batch.topk = UploadVec(topk);
  batch.indices_per_kv_head = UploadVec(perkv);
  batch.out = static_cast<uint16_t*>(Alloc(qn * 2));
  batch.lse = nullptr;
  // Host copies of the [B] arrays, as the backend passes them (--host_scalars).
  DecodeBatch host_batch;
  host_batch.num_requests = c.batch;
  host_batch.layer = layer.data();
  host_batch.page_table_offset = pto.data();
  host_batch.index_offset = io.data();
  host_batch.topk = topk.data();
  host_batch.indices_per_kv_head = perkv.data();
  // `ad_` cases: each request's new token (position seq_len - 1), [B, Hkv, D] bf16 K and
  // V, appended by the launch before the decode.
  std::vector<uint16_t> knew, vnew;
  std::vector<int32_t> alayer(c.batch, 0);
  std::vector<int64_t> aslot(c.batch);
  AppendBatch append{};
  if (c.append) {
    knew.resize(static_cast<size_t>(c.batch) * c.hkv * c.d);
    vnew.resize(knew.size());
    for (size_t i = 0; i < knew.size(); ++i) knew[i] = Bf16(nd(rng)), vnew[i] = Bf16(nd(rng));
    const int64_t last = c.seq_len - 1;
    for (int b = 0; b < c.batch; ++b)
      aslot[b] = static_cast<int64_t>(perm[pto[b] + last / c.page]) * c.page + last % c.page;
    append =
        AppendBatch{c.batch, UploadVec(knew), UploadVec(vnew), UploadVec(alayer), UploadVec(aslot)};
  }
  cuda::DecodeWorkspace ws;
  ws.capacity_floats = cuda::DecodeWorkspaceFloats(c.batch, c.hq, c.d, c.topk);
  ws.capacity_counters = cuda::DecodeWorkspaceCounters(c.batch, c.hkv);
  ws.partial = static_cast<float*>(Alloc(ws.capacity_floats * 4 + 16));
  ws.counters = static_cast<int32_t*>(Alloc(ws.capacity_counters * 4 + 16));
  Check(cudaMemset(ws.counters, 0, ws.capacity_counters * 4), "counters");
  Check(cudaDeviceSynchronize(), "setup");

  Result r;
  const double valid = static_cast<double>(c.batch) * std::min<int64_t>(c.topk, c.seq_len);
  const double row_bytes = 2.0 * c.d + (c.mode == ScaleMode::kPerTokenHead ? 8.0 : 0.0);
  r.min_bytes = valid * c.hkv * row_bytes + 3.0 * qn * 2 + 4.0 * c.batch * c.topk;
  r.floor_us = r.min_bytes / (read_gbs * 1e3);
  std::function<void()> refresh;
  if (g_warm_inputs) {
    refresh = [&] {
      Reupload(const_cast<uint16_t*>(batch.q), q, s);
      Reupload(const_cast<uint16_t*>(batch.gate), gate, s);
      Reupload(const_cast<int32_t*>(batch.layer), layer, s);
      Reupload(const_cast<int32_t*>(batch.page_table), perm, s);
      Reupload(const_cast<int64_t*>(batch.page_table_offset), pto, s);
      Reupload(const_cast<int32_t*>(batch.indices), indices, s);
      Reupload(const_cast<int64_t*>(batch.index_offset), io, s);
      Reupload(const_cast<int32_t*>(batch.topk), topk, s);
      Reupload(const_cast<uint8_t*>(batch.indices_per_kv_head), perkv, s);
    };
  }
  std::vector<uint16_t> outs[2];
  for (int k = 0; k < 2; ++k) {
    const cuda::DecodeKernel kernel = k == 0 ? cuda::DecodeKernel::kV1 : cuda::DecodeKernel::kV2;
    Check(cudaMemset(batch.out, 0xFF, qn * 2), "poison out");
    (k == 0 ? r.us : r.us_v2) = TimeMedianUs(
        [&] {
          absl::Status st = c.append ? cuda::LaunchAppend(view, append, s) : absl::OkStatus();
          if (st.ok())
            st = cuda::LaunchDecode(view, batch, c.topk, ws, s, kernel,
                                    g_host_scalars ? &host_batch : nullptr, c.append && g_pdl);
          if (!st.ok()) {
            std::fprintf(stderr, "%s: %s\n", c.name.c_str(), st.ToString().c_str());
            std::exit(2);
          }
        },
        iters, flush, s, refresh);
    // Sanity: the output must be finite and not all zero.
    std::vector<uint16_t>& out = outs[k];
    out.resize(qn);
    Check(cudaMemcpy(out.data(), batch.out, qn * 2, cudaMemcpyDeviceToHost), "download");
    size_t nonzero = 0, bad = 0;
    for (uint16_t x : out) {
      if ((x & 0x7F80) == 0x7F80) ++bad;
      if (x & 0x7FFF) ++nonzero;
    }
    if (bad || nonzero == 0) {
      std::fprintf(stderr, "%s v%d: bad output (%zu non-finite, %zu non-zero)\n", c.name.c_str(),
                   k + 1, bad, nonzero);
      g_failed = true;
    }
  }
  for (size_t i = 0; i < qn; ++i) {
    const double a = Bf16ToFloat(outs[0][i]), b = Bf16ToFloat(outs[1][i]);
    r.max_diff = std::max(r.max_diff, std::fabs(a - b));
    r.max_abs = std::max(r.max_abs, std::fabs(a));
  }
  for (const void* p :
       {static_cast<const void*>(view.k), static_cast<const void*>(view.v),
        static_cast<const void*>(dls), static_cast<const void*>(kts), static_cast<const void*>(vts),
        static_cast<const void*>(batch.q), static_cast<const void*>(batch.gate),
        static_cast<const void*>(batch.layer), static_cast<const void*>(batch.page_table),
        static_cast<const void*>(batch.page_table_offset), static_cast<const void*>(batch.indices),
        static_cast<const void*>(batch.index_offset), static_cast<const void*>(batch.topk),
        static_cast<const void*>(batch.indices_per_kv_head), static_cast<const void*>(batch.out),
        static_cast<const void*>(ws.partial), static_cast<const void*>(ws.counters)})
    if (p) cudaFree(const_cast<void*>(p));
  for (const void* p :
       {static_cast<const void*>(append.k_new), static_cast<const void*>(append.v_new),
        static_cast<const void*>(append.layer), static_cast<const void*>(append.slot)})
    if (p) cudaFree(const_cast<void*>(p));
  return r;
}

double RunAppendCase(int tokens, int hkv, int d, int iters, Flusher* flush, cudaStream_t s) {
  CacheGeometry geo{1, hkv, d, 16, 4096, ScaleMode::kPerTensor};
  CacheView view;
  view.geo = geo;
  view.k = static_cast<uint8_t*>(Alloc(geo.LayerElements()));
  view.v = static_cast<uint8_t*>(Alloc(geo.LayerElements()));
  std::vector<float> one = {0.05f};
  float* dls = UploadVec(one);
  view.layer_k_scale = dls;
  view.layer_v_scale = dls;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> kn(static_cast<size_t>(tokens) * hkv * d);
  for (auto& x : kn) x = Bf16(nd(rng));
  std::vector<int32_t> layer(tokens, 0);
  std::vector<int64_t> slot(tokens);
  for (int t = 0; t < tokens; ++t) slot[t] = static_cast<int64_t>(t) * 37 % (4096 * 16);
  AppendBatch ab{tokens, UploadVec(kn), UploadVec(kn), UploadVec(layer), UploadVec(slot)};
  const double us = TimeMedianUs(
      [&] {
        absl::Status st = cuda::LaunchAppend(view, ab, s);
        if (!st.ok()) std::exit(2);
      },
      iters, flush, s);
  cudaFree(view.k);
  cudaFree(view.v);
  return us;
}

}  // namespace
}  // namespace sds::cudabench

int main(int argc, char** argv) {
  using namespace sds::cudabench;
  using sds::ScaleMode;
  std::string only;
  int iters = 30;
  bool read_flush = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--case") && i + 1 < argc) only = argv[++i];
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--flush") && i + 1 < argc)
      read_flush = !std::strcmp(argv[++i], "read");
    if (!std::strcmp(argv[i], "--inputs") && i + 1 < argc)
      g_warm_inputs = !std::strcmp(argv[++i], "warm");
    if (!std::strcmp(argv[i], "--host_scalars") && i + 1 < argc)
      g_host_scalars = !std::strcmp(argv[++i], "on");
    if (!std::strcmp(argv[i], "--order") && i + 1 < argc)
      g_chunk_order = !std::strcmp(argv[++i], "chunk");
    if (!std::strcmp(argv[i], "--pdl") && i + 1 < argc) g_pdl = !std::strcmp(argv[++i], "on");
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "properties");
  cudaStream_t s;
  Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const double read_gbs = ReadPassGBs(s);
  std::printf("device: %s, %d SMs, L2 %d MB; read pass %.0f GB/s\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, read_gbs);
  const std::vector<Case> cases = {
      {"seed", 256, 32, 8, 128, 16, 512, 512, ScaleMode::kPerTensor, 1.15, 0},
      {"seed_tokenhead", 256, 32, 8, 128, 16, 512, 512, ScaleMode::kPerTokenHead, 1.15, 0},
      {"b64_k2048_32k", 64, 32, 8, 128, 16, 32768, 2048, ScaleMode::kPerTensor, 1.15, 0},
      {"b128_64x8_k2048", 128, 64, 8, 128, 16, 8192, 2048, ScaleMode::kPerTensor, 1.2, 0},
      {"b1_k2048_128k", 1, 32, 8, 128, 16, 131072, 2048, ScaleMode::kPerTensor, 0, 10},
      {"b8_k2048_128k", 8, 32, 8, 128, 16, 131072, 2048, ScaleMode::kPerTensor, 0, 15},
      // Diagnostics (no goal): one request with 16 indices (fixed latency) and with 512
      // (one chunk per KV head, no split-K merge).
      {"b1_k16_128k", 1, 32, 8, 128, 16, 131072, 16, ScaleMode::kPerTensor, 0, 0},
      {"b1_k512_128k", 1, 32, 8, 128, 16, 131072, 512, ScaleMode::kPerTensor, 0, 0},
      // 4 requests of 4 chunks: 128 CTAs, the largest grid on 132 SMs that merges its
      // chunks over distributed shared memory (clusters).
      {"b4_k2048_128k", 4, 32, 8, 128, 16, 131072, 2048, ScaleMode::kPerTensor, 0, 0},
      // Locality diagnostics: the seed and the 64 x 2048 lists in position order (what
      // reading whole pages in order could reach), not a goal shape.
      {"seed_sorted", 256, 32, 8, 128, 16, 512, 512, ScaleMode::kPerTensor, 0, 0, true},
      {"b64_sorted", 64, 32, 8, 128, 16, 32768, 2048, ScaleMode::kPerTensor, 0, 0, true},
      // Append of each request's new token, then the decode, timed together (the
      // backend's device work per batch; --pdl on|off: the decode's launch).
      {"ad_b1_k2048_128k", 1, 32, 8, 128, 16, 131072, 2048, ScaleMode::kPerTensor, 0, 0, false,
       true},
      {"ad_b8_k2048_128k", 8, 32, 8, 128, 16, 131072, 2048, ScaleMode::kPerTensor, 0, 0, false,
       true},
      {"ad_seed", 256, 32, 8, 128, 16, 512, 512, ScaleMode::kPerTensor, 0, 0, false, true},
  };
  Flusher flush(read_flush);
  std::printf("host copies of the per-request scalars passed to the decode launches: %s\n",
              g_host_scalars ? "on (as the backend)" : "off");
  std::printf("L2 flush before each timed launch: %s; inputs %s\n",
              read_flush ? "read of a separate 256 MiB buffer" : "256 MiB memset",
              g_warm_inputs ? "copied again after the flush (warm, as in the server)"
                            : "flushed with the cache (cold)");
  std::printf("index lists: %s; append + decode cases: decode launch %s\n",
              g_chunk_order ? "sorted by position within each chunk" : "random order",
              g_pdl ? "programmatic (PDL)" : "plain");
  std::vector<std::string> lines;
  char line[256];
  const char* v2_heads = std::getenv("SDS_DECODE_V2_HEADS");
  std::printf("v2 KV heads per CTA: %s\n", v2_heads ? v2_heads : "chosen per batch");
  // Backend cases run only when named (`--case backend` for all of them).
  if (only.rfind("backend", 0) == 0) {
#ifdef SDS_BENCH_BACKEND
    if (!RunBackendCases(only, s, &lines)) g_failed = true;
#else
    std::fprintf(stderr, "built without the CUDA backend: no backend cases\n");
    g_failed = true;
#endif
  }
  for (const Case& c : cases) {
    if (!only.empty() && only != c.name) continue;
    const Result r = RunDecodeCase(c, read_gbs, iters, &flush, s);
    const double ratio = r.us / r.floor_us, ratio_v2 = r.us_v2 / r.floor_us;
    const bool has_goal = c.goal_ratio > 0 || c.goal_us > 0;
    auto met = [&](double us, double rt) {
      return !has_goal                                                   ? "diag"
             : (c.goal_ratio > 0 ? rt <= c.goal_ratio : us <= c.goal_us) ? "met"
                                                                         : "MISSED";
    };
    if (!(r.us > 0) || !(r.us_v2 > 0)) g_failed = true;
    const std::string goal = !has_goal ? "-"
                             : c.goal_ratio > 0
                                 ? "<=" + std::to_string(c.goal_ratio).substr(0, 4) + "x"
                                 : "<=" + std::to_string(static_cast<int>(c.goal_us)) + "us";
    std::snprintf(line, sizeof line,
                  "%-18s %9.1f %9.1f %9.1f %7.3f %7.3f %8.1f  %-9s %-6s %-6s %.2g/%.2g",
                  c.name.c_str(), r.us, r.us_v2, r.floor_us, ratio, ratio_v2, r.min_bytes / 1e6,
                  goal.c_str(), met(r.us, ratio), met(r.us_v2, ratio_v2), r.max_diff, r.max_abs);
    lines.push_back(line);
    std::printf("%s\n", line);
    std::fflush(stdout);
  }
  if (only.empty() || only == "append") {
    const double us = RunAppendCase(256, 8, 128, iters, &flush, s);
    if (!(us > 0)) g_failed = true;
    std::snprintf(line, sizeof line, "%-18s %10.1f %10s %8s %9.1f  %-10s %s", "append_256tok", us,
                  "-", "-", 256.0 * 8 * 128 * 2 * 3 / 1e6, "<5us", us < 5 ? "met" : "MISSED");
    lines.push_back(line);
  }
  if (only.empty() || only == "append" || only == "diag") {
    const double us = TimeMedianUs([&] { Check(Empty(s), "empty kernel"); }, iters, &flush, s);
    std::snprintf(line, sizeof line, "%-18s %10.1f %10s %8s %9s  %-10s %s", "empty_kernel", us, "-",
                  "-", "-", "-", "launch floor");
    lines.push_back(line);
  }
  if (only.empty() || only == "diag") {
    for (int g : {4, 8}) {
      int blocks = 0;
      Check(sds::cuda::DecodeOccupancy(128, g, false, &blocks), "occupancy");
      std::printf("occupancy D128 G%d per_tensor: %d CTAs/SM\n", g, blocks);
      Check(sds::cuda::DecodeOccupancy(128, g, true, &blocks), "occupancy");
      std::printf("occupancy D128 G%d per_token_head: %d CTAs/SM\n", g, blocks);
    }
    for (int row : {128, 256, 1024})
      std::printf("random %4d-byte row gather over 512 MB: %.0f GB/s\n", row,
                  GatherGBs(int64_t{512} << 20, row, s));
  }
  Check(cudaDeviceSynchronize(), "final");
  std::printf("\n%-18s %9s %9s %9s %7s %7s %8s  %-9s %-6s %-6s %s\n", "case", "v1_us", "v2_us",
              "floor_us", "v1_rat", "v2_rat", "min_MB", "goal", "v1", "v2", "maxdiff/max");
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  std::printf("read pass %.0f GB/s on %s\n", read_gbs, prop.name);
  return g_failed ? 1 : 0;
}
