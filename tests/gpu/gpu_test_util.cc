#include "tests/gpu/gpu_test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>

#include "kernels/cpu_append.h"
#include "kernels/cuda/cuda_kernels.h"
#include "tests/reference/reference_decode.h"

namespace sds::gputest {

bool HaveGpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return false;
  return prop.major == 9 && prop.minor == 0;
}

void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(err));
  std::abort();
}

int SmCount() {
  int device = 0, sms = 0;
  Check(cudaGetDevice(&device), "current device");
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  return sms;
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) Check(cudaMalloc(&ptr_, bytes), "cudaMalloc");
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

uint16_t RandomBf16(std::mt19937& rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  return ref::FloatToBf16(dist(rng));
}

CacheView TestCache::HostView() {
  CacheView view;
  view.geo = geo;
  view.k = k.data();
  view.v = v.data();
  if (geo.scale_mode == ScaleMode::kPerTokenHead) {
    view.k_token_scale = k_ts.data();
    view.v_token_scale = v_ts.data();
  } else {
    view.layer_k_scale = layer_k.data();
    view.layer_v_scale = layer_v.data();
  }
  return view;
}

CacheView TestCache::DeviceView() const {
  CacheView view;
  view.geo = geo;
  view.k = dk.as<uint8_t>();
  view.v = dv.as<uint8_t>();
  if (geo.scale_mode == ScaleMode::kPerTokenHead) {
    view.k_token_scale = dk_ts.as<float>();
    view.v_token_scale = dv_ts.as<float>();
  } else {
    view.layer_k_scale = dlayer_k.as<float>();
    view.layer_v_scale = dlayer_v.as<float>();
  }
  return view;
}

void TestCache::UploadAll() {
  dk = Upload(k);
  dv = Upload(v);
  dk_ts = Upload(k_ts);
  dv_ts = Upload(v_ts);
  dlayer_k = Upload(layer_k);
  dlayer_v = Upload(layer_v);
}

TestCache BuildCache(int layers, int hkv, int head_dim, int page_size, ScaleMode mode,
                     const std::vector<int32_t>& lengths, uint32_t seed) {
  std::mt19937 rng(seed);
  TestCache c;
  c.lengths = lengths;
  int64_t total_pages = 0;
  for (int32_t len : lengths) total_pages += (len + page_size - 1) / page_size;
  total_pages += 3;  // a few pages nobody owns
  c.geo.num_layers = layers;
  c.geo.num_kv_heads = hkv;
  c.geo.head_dim = head_dim;
  c.geo.page_size = page_size;
  c.geo.num_pages = total_pages;
  c.geo.scale_mode = mode;
  const int64_t elems = c.geo.LayerElements() * layers;
  const int64_t scales = c.geo.LayerScales() * layers;
  // Unowned slots hold random bytes (never NaN codes) so that a wrong row shows up.
  c.k.resize(elems);
  c.v.resize(elems);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto* arr : {&c.k, &c.v})
    for (auto& x : *arr) {
      x = static_cast<uint8_t>(byte(rng));
      if ((x & 0x7F) == 0x7F) x = 0x3F;
    }
  c.k_ts.assign(mode == ScaleMode::kPerTokenHead ? scales : 0, 1.0f);
  c.v_ts.assign(mode == ScaleMode::kPerTokenHead ? scales : 0, 1.0f);
  std::uniform_real_distribution<float> uni(0.5f, 2.0f);
  for (int l = 0; l < layers; ++l) {
    c.layer_k.push_back(0.02f * uni(rng));
    c.layer_v.push_back(0.02f * uni(rng));
  }
  std::vector<int32_t> order(total_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  size_t next = 0;
  CacheView host = c.HostView();
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int npages = (lengths[s] + page_size - 1) / page_size;
    std::vector<int32_t> pg(order.begin() + next, order.begin() + next + npages);
    next += npages;
    c.pages.push_back(pg);
    // Append every token of every layer: rows with different magnitudes per token.
    const int n = lengths[s];
    for (int l = 0; l < layers; ++l) {
      std::vector<uint16_t> kn(static_cast<size_t>(n) * hkv * head_dim);
      std::vector<uint16_t> vn(kn.size());
      std::vector<int32_t> lay(n, l);
      std::vector<int64_t> slot(n);
      for (int t = 0; t < n; ++t) {
        slot[t] = static_cast<int64_t>(pg[t / page_size]) * page_size + t % page_size;
        const float mag = std::exp(std::uniform_real_distribution<float>(-1.5f, 1.5f)(rng));
        for (int e = 0; e < hkv * head_dim; ++e) {
          kn[static_cast<size_t>(t) * hkv * head_dim + e] = RandomBf16(rng, mag);
          vn[static_cast<size_t>(t) * hkv * head_dim + e] = RandomBf16(rng, mag);
        }
      }
      AppendBatch ab;
      ab.num_tokens = n;
      ab.k_new = kn.data();
      ab.v_new = vn.data();
      ab.layer = lay.data();
      ab.slot = slot.data();
      CpuAppend(host, ab);
    }
  }
  c.UploadAll();
  return c;
}

DecodeBatch TestBatch::HostBatch(uint16_t* out, float* lse) const {
  DecodeBatch b;
  b.num_requests = size();
  b.num_q_heads = hq;
  b.q = q.data();
  b.gate = gate.data();
  b.layer = layer.data();
  b.page_table = page_table.data();
  b.page_table_offset = page_table_offset.data();
  b.indices = indices.data();
  b.index_offset = index_offset.data();
  b.topk = topk.data();
  b.indices_per_kv_head = per_kv.data();
  b.out = out;
  b.lse = lse;
  return b;
}

DecodeBatch TestBatch::DeviceBatch(bool with_lse) const {
  DecodeBatch b;
  b.num_requests = size();
  b.num_q_heads = hq;
  b.q = dq.as<uint16_t>();
  b.gate = dgate.as<uint16_t>();
  b.layer = dlayer.as<int32_t>();
  b.page_table = dpt.as<int32_t>();
  b.page_table_offset = dpto.as<int64_t>();
  b.indices = didx.as<int32_t>();
  b.index_offset = didxo.as<int64_t>();
  b.topk = dtopk.as<int32_t>();
  b.indices_per_kv_head = dperkv.as<uint8_t>();
  b.out = dout.as<uint16_t>();
  b.lse = with_lse ? dlse.as<float>() : nullptr;
  return b;
}

void TestBatch::Poison() {
  Check(cudaMemset(dout.get(), 0xFF, dout.bytes()), "poison out");
  Check(cudaMemset(dlse.get(), 0xFF, dlse.bytes()), "poison lse");
}

// Indices of one list: random positions, runs across page boundaries, duplicates, -1.
static std::vector<int32_t> MakeList(std::mt19937& rng, int topk, int len, int page_size) {
  std::vector<int32_t> list(topk);
  std::uniform_int_distribution<int32_t> pos(0, len - 1);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int i = 0; i < topk; ++i) {
    const float r = u(rng);
    if (r < 0.08f) {
      list[i] = -1;
    } else if (r < 0.12f && i > 0 && list[i - 1] >= 0) {
      list[i] = list[i - 1];  // duplicate
    } else if (r < 0.3f && i > 0 && list[i - 1] >= 0 && list[i - 1] + 1 < len) {
      list[i] = list[i - 1] + 1;  // runs, crossing page boundaries
    } else if (r < 0.35f) {
      list[i] = std::min(len - 1, (pos(rng) / page_size) * page_size + page_size - 1);
    } else {
      list[i] = pos(rng);
    }
  }
  // The last position (the token just written) is always attended when K > 1.
  if (topk > 1) list[topk / 2] = len - 1;
  return list;
}

TestBatch BuildBatch(const TestCache& cache, int hq, const std::vector<RequestSpec>& specs) {
  TestBatch b;
  b.hq = hq;
  b.hkv = cache.geo.num_kv_heads;
  b.d = cache.geo.head_dim;
  const size_t row = static_cast<size_t>(hq) * b.d;
  for (const RequestSpec& s : specs) {
    std::mt19937 rng(s.seed);
    for (size_t e = 0; e < row; ++e) b.q.push_back(RandomBf16(rng, 1.0f));
    for (size_t e = 0; e < row; ++e) b.gate.push_back(RandomBf16(rng, 2.0f));
    b.layer.push_back(s.layer);
    b.page_table_offset.push_back(static_cast<int64_t>(b.page_table.size()));
    const auto& pg = cache.pages[s.seq];
    b.page_table.insert(b.page_table.end(), pg.begin(), pg.end());
    b.index_offset.push_back(static_cast<int64_t>(b.indices.size()));
    b.topk.push_back(s.topk);
    b.per_kv.push_back(s.per_kv_head ? 1 : 0);
    const int lists = s.per_kv_head ? b.hkv : 1;
    for (int h = 0; h < lists; ++h) {
      auto list = MakeList(rng, s.topk, cache.lengths[s.seq], cache.geo.page_size);
      b.indices.insert(b.indices.end(), list.begin(), list.end());
    }
    b.max_topk = std::max(b.max_topk, s.topk);
  }
  b.dq = Upload(b.q);
  b.dgate = Upload(b.gate);
  b.dlayer = Upload(b.layer);
  b.dpt = Upload(b.page_table);
  b.dpto = Upload(b.page_table_offset);
  b.didx = Upload(b.indices);
  b.didxo = Upload(b.index_offset);
  b.dtopk = Upload(b.topk);
  b.dperkv = Upload(b.per_kv);
  b.dout = DeviceBuffer(row * specs.size() * sizeof(uint16_t));
  b.dlse = DeviceBuffer(static_cast<size_t>(hq) * specs.size() * sizeof(float));
  return b;
}

std::string KernelName(cuda::DecodeKernel kernel) {
  switch (kernel) {
    case cuda::DecodeKernel::kV1:
      return "v1";
    case cuda::DecodeKernel::kV2:
      return "v2";
    case cuda::DecodeKernel::kV2Coarse:
      return "v2coarse";
    case cuda::DecodeKernel::kV2Fine:
      return "v2fine";
    case cuda::DecodeKernel::kV1GlobalMerge:
      return "v1global";
    case cuda::DecodeKernel::kV1Fused:
      return "v1fused";
    case cuda::DecodeKernel::kV1PvWarp:
      return "v1pvwarp";
    case cuda::DecodeKernel::kV1PvWarpQkAhead:
      return "v1pvwarp_qkahead";
    default:
      return "default";
  }
}

void RunGpuDecode(const TestCache& cache, TestBatch& batch, bool with_lse,
                  std::vector<uint16_t>* out, std::vector<float>* lse, cuda::DecodeKernel kernel,
                  bool host_scalars, const DecodeBatch* host, const AppendBatch* append_first) {
  const int n = batch.size();
  cuda::DecodeWorkspace ws;
  ws.capacity_floats = cuda::DecodeWorkspaceFloats(n, batch.hq, batch.d, batch.max_topk);
  ws.capacity_counters = cuda::DecodeWorkspaceCounters(n, batch.hkv);
  DeviceBuffer partial(ws.capacity_floats * sizeof(float));
  DeviceBuffer counters(ws.capacity_counters * sizeof(int32_t));
  Check(cudaMemset(counters.get(), 0, counters.bytes()), "zero counters");
  ws.partial = partial.as<float>();
  ws.counters = counters.as<int32_t>();
  batch.Poison();
  const DecodeBatch own = batch.HostBatch(nullptr, nullptr);
  const DecodeBatch* copies = host_scalars ? (host != nullptr ? host : &own) : nullptr;
  cudaStream_t stream = nullptr;  // the legacy default stream unless append_first
  if (append_first != nullptr) {
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const absl::Status s = cuda::LaunchAppend(cache.DeviceView(), *append_first, stream);
    if (!s.ok()) {
      std::fprintf(stderr, "LaunchAppend: %s\n", s.ToString().c_str());
      std::abort();
    }
  }
  absl::Status s =
      cuda::LaunchDecode(cache.DeviceView(), batch.DeviceBatch(with_lse), batch.max_topk, ws,
                         stream, kernel, copies, /*after_append=*/append_first != nullptr);
  if (!s.ok()) {
    std::fprintf(stderr, "LaunchDecode: %s\n", s.ToString().c_str());
    std::abort();
  }
  Check(cudaDeviceSynchronize(), "decode kernel");
  if (stream != nullptr) Check(cudaStreamDestroy(stream), "stream");
  *out = Download<uint16_t>(batch.dout, static_cast<size_t>(n) * batch.hq * batch.d);
  *lse = Download<float>(batch.dlse, static_cast<size_t>(n) * batch.hq);
}

std::string CompareWithReference(TestCache& cache, const TestBatch& batch, int b,
                                 const std::vector<uint16_t>& out, const std::vector<float>& lse,
                                 double ulps) {
  const DecodeBatch host = batch.HostBatch(nullptr, nullptr);
  const ref::RowResult want = ref::ReferenceDecode(cache.HostView(), host, b);
  std::ostringstream err;
  int failures = 0;
  const int d = batch.d;
  for (int h = 0; h < batch.hq; ++h) {
    const size_t base = (static_cast<size_t>(b) * batch.hq + h) * d;
    const bool empty = std::isinf(want.lse[h]);
    for (int j = 0; j < d; ++j) {
      const uint16_t got = out[base + j];
      std::string msg;
      if (empty) {
        if (got != 0) msg = "row without valid index must be +0, got bits " + std::to_string(got);
      } else {
        msg = ref::CheckOutputElement(want, h, j, d, got, ulps);
      }
      if (!msg.empty() && failures++ < 5)
        err << "req " << b << " head " << h << " d " << j << ": " << msg << "\n";
    }
    const float gl = lse[static_cast<size_t>(b) * batch.hq + h];
    const bool lse_ok =
        empty ? (std::isinf(gl) && gl < 0)
              : std::fabs(gl - want.lse[h]) <= 1e-4 * std::max(1.0, std::fabs(want.lse[h]));
    if (!lse_ok && failures++ < 5)
      err << "req " << b << " head " << h << ": lse " << gl << " want " << want.lse[h] << "\n";
  }
  if (failures) err << failures << " failures in request " << b << "\n";
  return err.str();
}

}  // namespace sds::gputest
