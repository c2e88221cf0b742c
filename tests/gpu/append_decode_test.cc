// One batch's append and decode on one stream, launched as the CUDA backend launches them
// (the decode with programmatic dependent launch after the append): the decode must read
// the rows its own append wrote, never what the cache held there before.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu_append.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/decode_params_cuda.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/reference/reference_decode.h"

namespace sds::gputest {
namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 16, kRequests = 17;
constexpr int kG = kHq / kHkv;

// Host copies of the device cache arrays that the append overwrites.
struct CacheBytes {
  std::vector<uint8_t> k, v;
  std::vector<float> k_ts, v_ts;
};

void UploadBytes(const CacheBytes& bytes, TestCache& cache) {
  Check(cudaMemcpy(cache.dk.get(), bytes.k.data(), bytes.k.size(), cudaMemcpyHostToDevice), "k");
  Check(cudaMemcpy(cache.dv.get(), bytes.v.data(), bytes.v.size(), cudaMemcpyHostToDevice), "v");
  if (!bytes.k_ts.empty()) {
    Check(cudaMemcpy(cache.dk_ts.get(), bytes.k_ts.data(), bytes.k_ts.size() * 4,
                     cudaMemcpyHostToDevice),
          "k scales");
    Check(cudaMemcpy(cache.dv_ts.get(), bytes.v_ts.data(), bytes.v_ts.size() * 4,
                     cudaMemcpyHostToDevice),
          "v scales");
  }
}

// Requests 0 .. size - 1: request b reads sequence b (layer 0); its new token (position
// length - 1) opens every 512-index chunk of every list, so each CTA's first cache copy
// (warp 0, step 0) is that row.
TestBatch NewTokenBatch(const TestCache& cache, int size) {
  const int topks[] = {2048, 600, 1, 513, 1024, 16, 2000, 777};
  std::vector<RequestSpec> specs;
  for (int i = 0; i < size; ++i)
    specs.push_back(RequestSpec{i, 0, topks[i % 8], i % 3 == 1, 900u + i});
  TestBatch batch = BuildBatch(cache, kHq, specs);
  for (int b = 0; b < size; ++b) {
    const int lists = batch.per_kv[b] ? kHkv : 1;
    for (int h = 0; h < lists; ++h)
      for (int i = 0; i < batch.topk[b]; i += cuda::kDecodeChunkTokens)
        batch.indices[batch.index_offset[b] + static_cast<int64_t>(h) * batch.topk[b] + i] =
            cache.lengths[b] - 1;
  }
  batch.didx = Upload(batch.indices);
  return batch;
}

// Pinned host memory mapped into the device address space (the GPU reads it over PCIe).
class MappedHost {
 public:
  explicit MappedHost(size_t bytes) {
    Check(cudaHostAlloc(&host_, bytes, cudaHostAllocMapped), "cudaHostAlloc");
    Check(cudaHostGetDevicePointer(&device_, host_, 0), "cudaHostGetDevicePointer");
  }
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;
  ~MappedHost() { cudaFreeHost(host_); }
  template <typename T>
  T* Fill(const std::vector<T>& from) {
    std::memcpy(host_, from.data(), from.size() * sizeof(T));
    return static_cast<T*>(device_);
  }

 private:
  void* host_ = nullptr;
  void* device_ = nullptr;
};

class AppendThenDecode : public ::testing::TestWithParam<ScaleMode> {};

// The device cache holds other ("stale") rows at the new tokens' positions until the
// append has run. Each new token's key is twice the sum of its request's queries of that
// KV head, so it takes most of the attention: a decode that read a stale row is far off
// the reference (checked below: the stale cache's reference differs by much more than the
// tolerance). The append's inputs live in device memory (as in the backend), then in
// mapped host memory (read over PCIe, so the append stores later). What it can catch: a
// decode not ordered after its append. What it could not: on the H200 (2026-11-29) two
// race mutants passed 6 runs each (the append allowing the launch before its stores, with
// the decode's griddepcontrol.wait removed, or moved below its prologue's cache copies):
// the decode's own chain (launch, index list, page table) outlasted this append.
TEST_P(AppendThenDecode, DecodeReadsTheNewTokensItsAppendWrote) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const ScaleMode mode = GetParam();
  std::vector<int32_t> lengths;
  for (int i = 0; i < kRequests; ++i) lengths.push_back(300 + 41 * i);
  TestCache cache = BuildCache(1, kHkv, kD, kPage, mode, lengths, 4242);
  const TestBatch all = NewTokenBatch(cache, kRequests);

  // Append rows [kRequests, Hkv, D]: request b's new token.
  const size_t row = static_cast<size_t>(kHkv) * kD;
  std::vector<uint16_t> kn(kRequests * row), vn(kRequests * row);
  std::vector<int32_t> layer(kRequests, 0);
  std::vector<int64_t> slot(kRequests);
  std::mt19937 rng(99);
  for (auto& x : vn) x = RandomBf16(rng, 1.0f);
  for (int b = 0; b < kRequests; ++b) {
    const int pos = lengths[b] - 1;
    slot[b] = static_cast<int64_t>(cache.pages[b][pos / kPage]) * kPage + pos % kPage;
    for (int h = 0; h < kHkv; ++h)
      for (int j = 0; j < kD; ++j) {
        double sum = 0;
        for (int g = h * kG; g < (h + 1) * kG; ++g)
          sum += ref::Bf16ToDouble(all.q[(static_cast<size_t>(b) * kHq + g) * kD + j]);
        kn[b * row + h * kD + j] = ref::FloatToBf16(static_cast<float>(2.0 * sum));
      }
  }
  CacheBytes stale{cache.k, cache.v, cache.k_ts, cache.v_ts};
  CpuAppend(cache.HostView(),
            AppendBatch{kRequests, kn.data(), vn.data(), layer.data(), slot.data()});

  // The stale cache's reference is far from the fresh one for every request.
  CacheView stale_view = cache.HostView();
  stale_view.k = stale.k.data();
  stale_view.v = stale.v.data();
  if (mode == ScaleMode::kPerTokenHead) {
    stale_view.k_token_scale = stale.k_ts.data();
    stale_view.v_token_scale = stale.v_ts.data();
  }
  const DecodeBatch host = all.HostBatch(nullptr, nullptr);
  for (int b = 0; b < kRequests; ++b) {
    const ref::RowResult fresh = ref::ReferenceDecode(cache.HostView(), host, b);
    const ref::RowResult old = ref::ReferenceDecode(stale_view, host, b);
    double max_abs = 0, max_diff = 0;
    for (size_t e = 0; e < fresh.out.size(); ++e) {
      max_abs = std::max(max_abs, std::fabs(fresh.out[e]));
      max_diff = std::max(max_diff, std::fabs(fresh.out[e] - old.out[e]));
    }
    EXPECT_GT(max_diff, 0.1 * max_abs) << "request " << b << ": a stale read would pass";
  }

  const DeviceBuffer dkn = Upload(kn), dvn = Upload(vn), dlayer = Upload(layer),
                     dslot = Upload(slot);
  MappedHost hkn(kn.size() * 2), hvn(vn.size() * 2), hlayer(kRequests * 4), hslot(kRequests * 8);
  const AppendBatch appends[2] = {
      {kRequests, dkn.as<uint16_t>(), dvn.as<uint16_t>(), dlayer.as<int32_t>(),
       dslot.as<int64_t>()},
      {kRequests, hkn.Fill(kn), hvn.Fill(vn), hlayer.Fill(layer), hslot.Fill(slot)}};
  for (int mapped = 0; mapped < 2; ++mapped) {
    // 3 requests: clusters merge the chunks, scalars in the launch parameters; 17: the
    // global workspace, scalars in global memory. Stale rows on the device before each.
    // Every v1 kernel: one warp per sequence, and PV warps (whose softmax warp issues
    // the first cache copies after the dependency wait) with and without QK ahead.
    for (int size : {3, kRequests})
      for (cuda::DecodeKernel kernel : {cuda::DecodeKernel::kV1Fused, cuda::DecodeKernel::kV1PvWarp,
                                        cuda::DecodeKernel::kV1PvWarpQkAhead}) {
        SCOPED_TRACE(testing::Message()
                     << size << " requests, append inputs in "
                     << (mapped ? "mapped host" : "device") << " memory, " << KernelName(kernel));
        UploadBytes(stale, cache);
        TestBatch batch = NewTokenBatch(cache, size);
        AppendBatch append = appends[mapped];
        append.num_tokens = size;  // requests 0 .. size - 1
        std::vector<uint16_t> out;
        std::vector<float> lse;
        RunGpuDecode(cache, batch, /*with_lse=*/true, &out, &lse, kernel,
                     /*host_scalars=*/true, nullptr, &append);
        for (int b = 0; b < size; ++b)
          EXPECT_EQ(CompareWithReference(cache, batch, b, out, lse, 2.0), "");
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, AppendThenDecode,
                         ::testing::Values(ScaleMode::kPerTensor, ScaleMode::kPerTokenHead));

}  // namespace
}  // namespace sds::gputest
