// GPU append against CpuAppend: cache bytes and scales bit-identical.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu_append.h"
#include "kernels/cuda/cuda_kernels.h"
#include "tests/gpu/gpu_test_util.h"

namespace sds::gputest {
namespace {

class AppendVsCpu : public ::testing::TestWithParam<std::tuple<int, ScaleMode>> {};

TEST_P(AppendVsCpu, BitIdentical) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const int d = std::get<0>(GetParam());
  const ScaleMode mode = std::get<1>(GetParam());
  std::mt19937 rng(d * 7 + static_cast<int>(mode));
  TestCache c;
  c.geo = CacheGeometry{3, 4, d, 16, 40, mode};
  const int64_t elems = c.geo.LayerElements() * 3, scales = c.geo.LayerScales() * 3;
  c.k.assign(elems, 0x11);
  c.v.assign(elems, 0x22);
  c.k_ts.assign(mode == ScaleMode::kPerTokenHead ? scales : 0, 3.0f);
  c.v_ts.assign(mode == ScaleMode::kPerTokenHead ? scales : 0, 5.0f);
  c.layer_k = {0.01f, 0.37f, 1.0f};
  c.layer_v = {0.02f, 0.5f, 3.0f};
  c.UploadAll();

  const int n = 300;
  std::vector<int64_t> slots(40 * 16);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n);
  std::vector<int32_t> layer(n);
  std::vector<uint16_t> kn(static_cast<size_t>(n) * 4 * d), vn(kn.size());
  std::uniform_real_distribution<float> mag(-12.0f, 12.0f);
  for (int t = 0; t < n; ++t) {
    layer[t] = t % 3;
    for (int h = 0; h < 4; ++h) {
      const float m = std::exp2(mag(rng));
      const bool zero = (t * 4 + h) % 23 == 0;
      for (int j = 0; j < d; ++j) {
        const size_t at = (static_cast<size_t>(t) * 4 + h) * d + j;
        kn[at] = zero ? 0 : RandomBf16(rng, m);
        vn[at] = zero ? 0x8000 : RandomBf16(rng, m * 0.5f);  // -0 row too
      }
    }
  }
  AppendBatch host{n, kn.data(), vn.data(), layer.data(), slots.data()};
  CpuAppend(c.HostView(), host);

  DeviceBuffer dkn = Upload(kn), dvn = Upload(vn), dl = Upload(layer), ds = Upload(slots);
  AppendBatch dev{n, dkn.as<uint16_t>(), dvn.as<uint16_t>(), dl.as<int32_t>(), ds.as<int64_t>()};
  ASSERT_TRUE(cuda::LaunchAppend(c.DeviceView(), dev, 0).ok());
  Check(cudaDeviceSynchronize(), "append kernel");
  EXPECT_TRUE(Download<uint8_t>(c.dk, elems) == c.k);
  EXPECT_TRUE(Download<uint8_t>(c.dv, elems) == c.v);
  if (mode == ScaleMode::kPerTokenHead) {
    auto kts = Download<float>(c.dk_ts, scales), vts = Download<float>(c.dv_ts, scales);
    EXPECT_EQ(0, std::memcmp(kts.data(), c.k_ts.data(), scales * 4));
    EXPECT_EQ(0, std::memcmp(vts.data(), c.v_ts.data(), scales * 4));
  }
}

INSTANTIATE_TEST_SUITE_P(All, AppendVsCpu,
                         ::testing::Combine(::testing::Values(64, 128, 256),
                                            ::testing::Values(ScaleMode::kPerTensor,
                                                              ScaleMode::kPerTokenHead)));

}  // namespace
}  // namespace sds::gputest
