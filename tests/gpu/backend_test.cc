// The CUDA backend end to end: cache in device memory, append then decode through Run,
// compared with the float64 reference over a host copy of the device cache.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "server/backend.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/reference/reference_decode.h"

namespace sds::gputest {
namespace {

BackendConfig SmallConfig(ScaleMode mode) {
  BackendConfig config;
  config.cache.num_layers = 2;
  config.cache.num_kv_heads = 8;
  config.cache.head_dim = 128;
  config.cache.page_size = 16;
  config.cache.num_pages = 256;
  config.cache.scale_mode = mode;
  if (mode == ScaleMode::kPerTensor) {
    config.cache.layer_k_scales = {0.02f, 0.03f};
    config.cache.layer_v_scales = {0.025f, 0.015f};
  }
  config.num_q_heads = 32;
  config.max_batch_size = 8;
  config.max_topk = 2048;
  return config;
}

TEST(CudaBackend, RejectsUnsupportedShapes) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  BackendConfig config = SmallConfig(ScaleMode::kPerTensor);
  config.cache.head_dim = 96;
  EXPECT_EQ(CreateCudaBackend(config).status().code(), absl::StatusCode::kInvalidArgument);
  config = SmallConfig(ScaleMode::kPerTensor);
  config.num_q_heads = 8 * 17;
  EXPECT_EQ(CreateCudaBackend(config).status().code(), absl::StatusCode::kInvalidArgument);
}

class CudaBackendEndToEnd : public ::testing::TestWithParam<ScaleMode> {};

TEST_P(CudaBackendEndToEnd, AppendThenDecodeMatchesReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  ASSERT_TRUE(CudaDeviceAvailable());
  const BackendConfig config = SmallConfig(GetParam());
  auto created = CreateCudaBackend(config);
  ASSERT_TRUE(created.ok()) << created.status();
  Backend& backend = **created;
  EXPECT_EQ(backend.name(), "cuda");
  PagedKvCache& cache = backend.cache();
  const int hkv = 8, d = 128, hq = 32;
  const int lengths[2] = {700, 1300};
  std::mt19937 rng(3);
  // Append every position of both layers of two sequences through the backend.
  for (int s = 0; s < 2; ++s) {
    const std::string id = "seq" + std::to_string(s);
    ASSERT_TRUE(cache.CreateSequence(id, 0).ok());
    for (int layer = 0; layer < 2; ++layer) {
      const int n = lengths[s];
      std::vector<int64_t> slots;
      ASSERT_TRUE(cache.PrepareWrite(id, layer, 0, n, &slots).ok());
      const size_t elems = static_cast<size_t>(n) * hkv * d;
      auto* k = static_cast<uint16_t*>(backend.AllocateStaging(elems * 2));
      auto* v = static_cast<uint16_t*>(backend.AllocateStaging(elems * 2));
      auto* lay = static_cast<int32_t*>(backend.AllocateStaging(n * 4));
      auto* sl = static_cast<int64_t*>(backend.AllocateStaging(n * 8));
      ASSERT_TRUE(k && v && lay && sl);
      for (size_t e = 0; e < elems; ++e) k[e] = RandomBf16(rng, 1.0f), v[e] = RandomBf16(rng, 1.0f);
      for (int t = 0; t < n; ++t) lay[t] = layer, sl[t] = slots[t];
      BatchWork work;
      work.append = AppendBatch{n, k, v, lay, sl};
      BatchTiming timing;
      ASSERT_TRUE(backend.Run(work, &timing).ok());
      ASSERT_TRUE(cache.CommitWrite(id, layer, 0, n).ok());
      backend.FreeStaging(k);
      backend.FreeStaging(v);
      backend.FreeStaging(lay);
      backend.FreeStaging(sl);
    }
  }
  // A decode batch of 3 requests (one of them with per-KV-head lists).
  const int b = 3;
  const int topk[b] = {600, 1, 1500};
  const int seq[b] = {0, 1, 1};
  std::vector<int32_t> page_table, indices, layer, tk;
  std::vector<int64_t> pto, io;
  std::vector<uint8_t> perkv;
  for (int r = 0; r < b; ++r) {
    pto.push_back(page_table.size());
    ASSERT_TRUE(cache.AppendPageTable("seq" + std::to_string(seq[r]), &page_table).ok());
    io.push_back(indices.size());
    perkv.push_back(r == 2);
    const int lists = r == 2 ? hkv : 1;
    std::uniform_int_distribution<int> pos(0, lengths[seq[r]] - 1);
    for (int i = 0; i < topk[r] * lists; ++i) indices.push_back(i % 11 == 0 ? -1 : pos(rng));
    layer.push_back(r % 2);
    tk.push_back(topk[r]);
  }
  const size_t qe = static_cast<size_t>(b) * hq * d;
  std::vector<uint16_t> q(qe), gate(qe), out(qe, 0xFFFF);
  std::vector<float> lse(b * hq, NAN);
  for (size_t e = 0; e < qe; ++e) q[e] = RandomBf16(rng, 1.0f), gate[e] = RandomBf16(rng, 2.0f);
  BatchWork work;
  DecodeBatch& batch = work.decode;
  batch.num_requests = b;
  batch.num_q_heads = hq;
  batch.q = q.data();
  batch.gate = gate.data();
  batch.layer = layer.data();
  batch.page_table = page_table.data();
  batch.page_table_offset = pto.data();
  batch.indices = indices.data();
  batch.index_offset = io.data();
  batch.topk = tk.data();
  batch.indices_per_kv_head = perkv.data();
  batch.out = out.data();
  batch.lse = lse.data();
  BatchTiming timing;
  absl::Status st = backend.Run(work, &timing);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_GT(timing.compute_us, 0);

  // Host copy of the device cache for the reference.
  const CacheView dev = cache.view();
  TestCache host;
  host.geo = dev.geo;
  const int64_t elems = dev.geo.LayerElements() * dev.geo.num_layers;
  const int64_t scales = dev.geo.LayerScales() * dev.geo.num_layers;
  host.k.resize(elems);
  host.v.resize(elems);
  Check(cudaMemcpy(host.k.data(), dev.k, elems, cudaMemcpyDeviceToHost), "k");
  Check(cudaMemcpy(host.v.data(), dev.v, elems, cudaMemcpyDeviceToHost), "v");
  if (dev.geo.scale_mode == ScaleMode::kPerTokenHead) {
    host.k_ts.resize(scales);
    host.v_ts.resize(scales);
    Check(cudaMemcpy(host.k_ts.data(), dev.k_token_scale, scales * 4, cudaMemcpyDeviceToHost),
          "k scales");
    Check(cudaMemcpy(host.v_ts.data(), dev.v_token_scale, scales * 4, cudaMemcpyDeviceToHost),
          "v scales");
  } else {
    host.layer_k = config.cache.layer_k_scales;
    host.layer_v = config.cache.layer_v_scales;
  }
  const CacheView hv = host.HostView();
  for (int r = 0; r < b; ++r) {
    const ref::RowResult want = ref::ReferenceDecode(hv, batch, r);
    for (int h = 0; h < hq; ++h) {
      for (int j = 0; j < d; ++j) {
        const std::string msg =
            ref::CheckOutputElement(want, h, j, d, out[(r * hq + h) * d + j], 2.0);
        ASSERT_EQ(msg, "") << "request " << r << " head " << h << " d " << j;
      }
      if (std::isinf(want.lse[h])) {
        EXPECT_TRUE(std::isinf(lse[r * hq + h]) && lse[r * hq + h] < 0);
      } else {
        EXPECT_NEAR(lse[r * hq + h], want.lse[h], 1e-4 * std::max(1.0, std::fabs(want.lse[h])));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaBackendEndToEnd,
                         ::testing::Values(ScaleMode::kPerTensor, ScaleMode::kPerTokenHead));

}  // namespace
}  // namespace sds::gputest
