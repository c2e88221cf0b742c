// Backend-level benchmark: three CUDA backends, one copying every batch's inputs in and
// outputs back (`copy`), one writing the outputs straight into the mapped staging
// (`direct`, cuda_backend.h), one also reading q, gate and the new K/V in place there
// when they are too large for the input pack (`inplace`), the same decode batch (each request's
// new-token append, then the decode; 32/8 heads, D 128, page 64, per_tensor, shared index lists of
// distinct random positions) staged in each backend's staging memory, Run back to back as the
// server's executor does. Per (case, mode), two runs in the order copy, direct, inplace, inplace,
// direct, copy (drift shows as the spread of a mode's two runs):
//   compute_us  the backend's BatchTiming (CUDA events around its stream of work),
//               mean of the middle 80 % of the Runs (the events round to 1 us)
//   wall_us     host time of Run (enqueue, device work, synchronise), median
//   ratio       compute_us / floor_us, where floor_us is the two kernels alone on
//               device copies of the same inputs (same launches: host scalars, PDL),
//               median of CUDA-event times, measured in the same run.
// Outputs must be bit-identical between the modes (else the case fails).
// Three more rows per case, the inplace path under the server's conditions (two runs
// each):
//   inplace+fill every Run after the batch's inputs were rewritten into the staging by
//                this thread (the server's staging fill leaves them dirty in the CPU's
//                caches for the kernels' reads)
//   inplace+idle every Run after 5 ms without GPU work (a closed loop of large batches
//                leaves the GPU idle between them; SDS_BENCH_IDLE_US sets another gap)
//   inplace+read every Run after this thread read the previous Run's outputs (the
//                server encodes its answers from them: they sit in the CPU's caches
//                when the next batch's decode writes the same staging rows)
#include "bench/gpu/backend_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>

#include "bench/gpu/bench_kernels.h"
#include "kernels/cuda/cuda_kernels.h"
#include "server/backend.h"
#include "server/cuda/cuda_backend.h"
#include "server/cuda/input_upload.h"

namespace sds::cudabench {
namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 64;
constexpr int kWarm = 30, kRuns = 400;
volatile uint64_t g_sink = 0;  // keeps the inplace+read loads

// The inplace+idle gap: SDS_BENCH_IDLE_US from the environment, else 5000.
int64_t IdleUs() {
  static const int64_t us = [] {
    const char* v = std::getenv("SDS_BENCH_IDLE_US");
    return v != nullptr && *v != 0 ? std::atoll(v) : int64_t{5000};
  }();
  return us;
}

struct BackendCase {
  const char* name;
  int batch;
  int topk;
  int64_t seq_len;
};

constexpr int kNumModes = 3;
const char* const kModeName[kNumModes] = {"copy", "direct", "inplace"};

bool Ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(err));
  return false;
}

// Host data of one decode batch with its append.
struct HostBatch {
  int b = 0, topk = 0;
  std::vector<uint16_t> q, gate, k_new, v_new;  // [B, Hq, D], [B, Hkv, D]
  std::vector<int32_t> a_layer, layer, topks, indices, page_table;
  std::vector<int64_t> slot, index_offset, page_table_offset;
  std::vector<uint8_t> per_kv_head;
};

// One backend with the batch staged in its staging memory.
struct Staged {
  std::unique_ptr<Backend> backend;
  std::vector<void*> owned;
  BatchWork work;
  ~Staged() {
    for (void* p : owned) backend->FreeStaging(p);
  }
  // Rewrites the batch's inputs into the staging already allocated by StageBatch.
  void Refill(const HostBatch& h) const {
    auto put = [](const void* dst, const auto& v) {
      std::memcpy(const_cast<void*>(dst), v.data(), v.size() * sizeof(v[0]));
    };
    put(work.append.k_new, h.k_new);
    put(work.append.v_new, h.v_new);
    put(work.decode.q, h.q);
    put(work.decode.gate, h.gate);
    put(work.decode.indices, h.indices);
    put(work.decode.page_table, h.page_table);
  }
  template <typename T>
  T* Stage(const std::vector<T>& v) {
    void* p = backend->AllocateStaging(v.size() * sizeof(T) + 16);
    if (p == nullptr) return nullptr;
    owned.push_back(p);
    if (!v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(T));
    return static_cast<T*>(p);
  }
  bool StageBatch(const HostBatch& h) {
    AppendBatch& a = work.append;
    a.num_tokens = h.b;
    a.k_new = Stage(h.k_new);
    a.v_new = Stage(h.v_new);
    a.layer = Stage(h.a_layer);
    a.slot = Stage(h.slot);
    DecodeBatch& d = work.decode;
    d.num_requests = h.b;
    d.num_q_heads = kHq;
    d.q = Stage(h.q);
    d.gate = Stage(h.gate);
    d.layer = Stage(h.layer);
    d.page_table = Stage(h.page_table);
    d.page_table_offset = Stage(h.page_table_offset);
    d.indices = Stage(h.indices);
    d.index_offset = Stage(h.index_offset);
    d.topk = Stage(h.topks);
    d.indices_per_kv_head = Stage(h.per_kv_head);
    d.out = Stage(std::vector<uint16_t>(static_cast<size_t>(h.b) * kHq * kD, 0xFFFF));
    d.lse = nullptr;
    return a.k_new && a.v_new && a.layer && a.slot && d.q && d.gate && d.layer && d.page_table &&
           d.page_table_offset && d.indices && d.index_offset && d.topk && d.indices_per_kv_head &&
           d.out;
  }
};

struct Timing {
  double compute_us = 0, wall_us = 0;
};

// What happens before each timed Run (see the header).
enum class Before { kNothing, kFill, kIdle, kRead };

// `runs` Runs after kWarm: trimmed mean of compute_us, median wall time.
bool TimeRuns(const Staged& st, const HostBatch& h, Before before, int runs, Timing* t) {
  Backend& backend = *st.backend;
  const BatchWork& work = st.work;
  std::vector<double> compute, wall;
  for (int i = 0; i < kWarm + runs; ++i) {
    if (before == Before::kFill) st.Refill(h);
    if (before == Before::kIdle) std::this_thread::sleep_for(std::chrono::microseconds(IdleUs()));
    if (before == Before::kRead) {
      const auto* out = reinterpret_cast<const volatile uint64_t*>(work.decode.out);
      uint64_t sum = 0;
      for (int64_t w = 0; w < static_cast<int64_t>(h.q.size()) / 4; ++w) sum += out[w];
      g_sink = g_sink + sum;
    }
    BatchTiming timing;
    const auto start = std::chrono::steady_clock::now();
    const absl::Status status = backend.Run(work, &timing);
    const auto stop = std::chrono::steady_clock::now();
    if (!status.ok()) {
      std::fprintf(stderr, "backend Run: %s\n", status.ToString().c_str());
      return false;
    }
    if (i < kWarm) continue;
    compute.push_back(static_cast<double>(timing.compute_us));
    wall.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  std::sort(compute.begin(), compute.end());
  std::sort(wall.begin(), wall.end());
  const size_t cut = compute.size() / 10;
  t->compute_us = std::accumulate(compute.begin() + cut, compute.end() - cut, 0.0) /
                  static_cast<double>(compute.size() - 2 * cut);
  t->wall_us = wall[wall.size() / 2];
  return true;
}

template <typename T>
T* DeviceCopy(const std::vector<T>& v, std::vector<void*>* owned) {
  void* p = nullptr;
  if (!Ok(cudaMalloc(&p, v.size() * sizeof(T) + 16), "cudaMalloc")) return nullptr;
  owned->push_back(p);
  if (!v.empty() &&
      !Ok(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload"))
    return nullptr;
  return static_cast<T*>(p);
}

// The append and decode kernels alone, on device copies of the batch, against
// `backend`'s cache: median CUDA-event time of kRuns launches pairs (after kWarm).
bool FloorUs(Backend& backend, const HostBatch& h, cudaStream_t s, double* us) {
  std::vector<void*> owned;
  bool ok = true;
  CacheView view = backend.cache().view();
  const std::vector<float> scale = {0.05f};
  view.layer_k_scale = DeviceCopy(scale, &owned);
  view.layer_v_scale = view.layer_k_scale;
  AppendBatch a{h.b, DeviceCopy(h.k_new, &owned), DeviceCopy(h.v_new, &owned),
                DeviceCopy(h.a_layer, &owned), DeviceCopy(h.slot, &owned)};
  DecodeBatch d;
  d.num_requests = h.b;
  d.num_q_heads = kHq;
  d.q = DeviceCopy(h.q, &owned);
  d.gate = DeviceCopy(h.gate, &owned);
  d.layer = DeviceCopy(h.layer, &owned);
  d.page_table = DeviceCopy(h.page_table, &owned);
  d.page_table_offset = DeviceCopy(h.page_table_offset, &owned);
  d.indices = DeviceCopy(h.indices, &owned);
  d.index_offset = DeviceCopy(h.index_offset, &owned);
  d.topk = DeviceCopy(h.topks, &owned);
  d.indices_per_kv_head = DeviceCopy(h.per_kv_head, &owned);
  d.out = DeviceCopy(std::vector<uint16_t>(static_cast<size_t>(h.b) * kHq * kD), &owned);
  DecodeBatch host;  // the [B] arrays as the backend passes them (inline scalars)
  host.num_requests = h.b;
  host.layer = h.layer.data();
  host.page_table_offset = h.page_table_offset.data();
  host.index_offset = h.index_offset.data();
  host.topk = h.topks.data();
  host.indices_per_kv_head = h.per_kv_head.data();
  cuda::DecodeWorkspace ws;
  ws.capacity_floats = cuda::DecodeWorkspaceFloats(h.b, kHq, kD, h.topk);
  ws.capacity_counters = cuda::DecodeWorkspaceCounters(h.b, kHkv);
  void *partial = nullptr, *counters = nullptr;
  ok = ok && Ok(cudaMalloc(&partial, ws.capacity_floats * 4 + 16), "workspace") &&
       Ok(cudaMalloc(&counters, ws.capacity_counters * 4 + 16), "counters") &&
       Ok(cudaMemset(counters, 0, ws.capacity_counters * 4 + 16), "counters");
  owned.push_back(partial);
  owned.push_back(counters);
  ws.partial = static_cast<float*>(partial);
  ws.counters = static_cast<int32_t*>(counters);
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  ok = ok && Ok(cudaEventCreate(&e0), "event") && Ok(cudaEventCreate(&e1), "event");
  std::vector<float> ms;
  for (int i = 0; ok && i < kWarm + kRuns; ++i) {
    ok = Ok(cudaEventRecord(e0, s), "record");
    absl::Status st = cuda::LaunchAppend(view, a, s);
    if (st.ok())
      st = cuda::LaunchDecode(view, d, h.topk, ws, s, cuda::DecodeKernel::kDefault, &host, true);
    if (!st.ok()) {
      std::fprintf(stderr, "floor launches: %s\n", st.ToString().c_str());
      ok = false;
      break;
    }
    float t = 0;
    ok = ok && Ok(cudaEventRecord(e1, s), "record") && Ok(cudaEventSynchronize(e1), "sync") &&
         Ok(cudaEventElapsedTime(&t, e0, e1), "elapsed");
    if (i >= kWarm) ms.push_back(t);
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  for (void* p : owned) cudaFree(p);
  if (!ok || ms.empty()) return false;
  std::sort(ms.begin(), ms.end());
  *us = ms[ms.size() / 2] * 1000.0;
  return true;
}

bool RunCase(const BackendCase& c, cudaStream_t s, std::vector<std::string>* lines) {
  const int64_t pages_per_seq = (c.seq_len + kPage - 1) / kPage;
  BackendConfig config;
  config.cache.num_layers = 1;
  config.cache.num_kv_heads = kHkv;
  config.cache.head_dim = kD;
  config.cache.page_size = kPage;
  config.cache.num_pages = pages_per_seq * c.batch + 1;
  config.cache.layer_k_scales = {0.05f};
  config.cache.layer_v_scales = {0.05f};
  config.num_q_heads = kHq;
  config.max_batch_size = std::max(c.batch, 64);
  config.max_topk = 2048;

  HostBatch h;
  h.b = c.batch;
  h.topk = c.topk;
  std::vector<std::unique_ptr<Staged>> staged;
  for (int m = 0; m < kNumModes; ++m) {
    CudaBackendOptions options;
    // Every case takes m's path.
    options.direct_out_max_requests = m == 0 ? 0 : 1 << 20;
    options.in_place_inputs_max_requests = m == 2 ? 1 << 20 : 0;
    auto created = CreateCudaBackend(config, options);
    if (!created.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.name, created.status().ToString().c_str());
      return false;
    }
    auto st = std::make_unique<Staged>();
    st->backend = *std::move(created);
    PagedKvCache& cache = st->backend->cache();
    // Same calls in the same order: the same pages in every backend.
    for (int r = 0; r < c.batch; ++r) {
      const std::string id = "s" + std::to_string(r);
      std::vector<int64_t> slots;
      std::vector<int32_t> table;
      if (!cache.CreateSequence(id, 0).ok() ||
          !cache.PrepareWrite(id, 0, 0, c.seq_len, &slots).ok() ||
          !cache.CommitWrite(id, 0, 0, c.seq_len).ok() || !cache.AppendPageTable(id, &table).ok()) {
        std::fprintf(stderr, "%s: cache setup failed\n", c.name);
        return false;
      }
      if (m == 0) {
        h.slot.push_back(slots[c.seq_len - 1]);
        h.page_table_offset.push_back(static_cast<int64_t>(h.page_table.size()));
        h.page_table.insert(h.page_table.end(), table.begin(), table.end());
      }
    }
    const CacheView view = cache.view();
    const int64_t elems = view.geo.LayerElements();
    if (!Ok(FillFp8(view.k, elems, 1, s), "fill k") ||
        !Ok(FillFp8(view.v, elems, 2, s), "fill v") || !Ok(cudaStreamSynchronize(s), "fill"))
      return false;
    staged.push_back(std::move(st));
  }
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const size_t qe = static_cast<size_t>(c.batch) * kHq * kD;
  const size_t kve = static_cast<size_t>(c.batch) * kHkv * kD;
  for (size_t i = 0; i < qe; ++i) h.q.push_back(Bf16(nd(rng))), h.gate.push_back(Bf16(nd(rng)));
  for (size_t i = 0; i < kve; ++i)
    h.k_new.push_back(Bf16(nd(rng))), h.v_new.push_back(Bf16(nd(rng)));
  std::uniform_int_distribution<int64_t> pos(0, c.seq_len - 1);
  for (int r = 0; r < c.batch; ++r) {
    h.a_layer.push_back(0);
    h.layer.push_back(0);
    h.topks.push_back(c.topk);
    h.per_kv_head.push_back(0);
    h.index_offset.push_back(static_cast<int64_t>(h.indices.size()));
    std::vector<char> used(c.seq_len, 0);
    for (int i = 0; i < c.topk;) {
      const int64_t t = pos(rng);
      if (!used[t]) used[t] = 1, h.indices.push_back(static_cast<int32_t>(t)), ++i;
    }
  }
  for (auto& st : staged) {
    if (!st->StageBatch(h)) {
      std::fprintf(stderr, "%s: staging allocation failed\n", c.name);
      return false;
    }
  }
  Timing t[kNumModes][2];
  const int order[2 * kNumModes] = {0, 1, 2, 2, 1, 0};
  int seen[kNumModes] = {};
  for (int m : order) {
    if (!TimeRuns(*staged[m], h, Before::kNothing, kRuns, &t[m][seen[m]++])) return false;
    // inplace reads in place only what is too large for the input pack.
    const CudaBatchPath path = LastCudaBatchPath(*staged[m]->backend);
    const size_t piece = cudabackend::InputUpload::kPackPieceBytes;
    if (path.direct_out != (m >= 1) || path.in_place_q != (m == 2 && qe * 2 > piece) ||
        path.in_place_new_kv != (m == 2 && kve * 2 > piece)) {
      std::fprintf(stderr, "%s %s: the batch took another path\n", c.name, kModeName[m]);
      return false;
    }
  }
  bool same = true;
  for (int m = 1; m < kNumModes; ++m)
    same = same && std::memcmp(staged[m]->work.decode.out, staged[0]->work.decode.out, qe * 2) == 0;
  if (!same) std::fprintf(stderr, "%s: outputs differ between modes\n", c.name);
  double floor_us = 0;
  if (!FloorUs(*staged[0]->backend, h, s, &floor_us)) return false;
  // The server's conditions, inplace: fill, idle, read, read, idle, fill.
  Timing cond[3][2];
  const Before conds[6] = {Before::kFill, Before::kIdle, Before::kRead,
                           Before::kRead, Before::kIdle, Before::kFill};
  int cseen[3] = {};
  for (Before b : conds) {
    const int k = b == Before::kFill ? 0 : b == Before::kIdle ? 1 : 2;
    if (!TimeRuns(*staged[2], h, b, b == Before::kIdle ? 60 : kRuns, &cond[k][cseen[k]++]))
      return false;
  }
  char line[256];
  auto row = [&](const char* mode, const Timing(&r)[2]) {
    const double mean = (r[0].compute_us + r[1].compute_us) / 2;
    std::snprintf(line, sizeof line, "%-24s %-12s %8.1f %8.1f %8.1f %8.1f %8.1f %6.2f", c.name,
                  mode, r[0].compute_us, r[1].compute_us, r[0].wall_us, r[1].wall_us, floor_us,
                  mean / floor_us);
    std::printf("%s\n", line);
    lines->push_back(line);
  };
  for (int m = 0; m < kNumModes; ++m) row(kModeName[m], t[m]);
  row("inplace+fill", cond[0]);
  row("inplace+idle", cond[1]);
  row("inplace+read", cond[2]);
  std::fflush(stdout);
  return same;
}

}  // namespace

bool RunBackendCases(const std::string& only, cudaStream_t stream,
                     std::vector<std::string>* lines) {
  const BackendCase cases[] = {
      {"backend_b1_seed", 1, 512, 1024},          {"backend_b8_seed", 8, 512, 1024},
      {"backend_b32_seed", 32, 512, 1024},        {"backend_b64_seed", 64, 512, 1024},
      {"backend_b128_seed", 128, 512, 1024},      {"backend_b256_seed", 256, 512, 1024},
      {"backend_b1_k2048_128k", 1, 2048, 131072}, {"backend_b8_k2048_128k", 8, 2048, 131072},
  };
  char header[256];
  std::snprintf(header, sizeof header, "%-24s %-12s %8s %8s %8s %8s %8s %6s", "backend case",
                "mode", "comp_1", "comp_2", "wall_1", "wall_2", "floor", "ratio");
  std::printf("%s\n", header);
  lines->push_back(header);
  bool ok = true;
  for (const BackendCase& c : cases) {
    if (only != "backend" && only != c.name) continue;
    ok = RunCase(c, stream, lines) && ok;
  }
  return ok;
}

}  // namespace sds::cudabench
