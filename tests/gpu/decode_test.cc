// GPU sparse decode against the float64 reference and the CPU kernels, every element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/cpu_attention.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/kernel_launch.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/reference/reference_decode.h"

namespace sds::gputest {
namespace {

struct Config {
  int hq, hkv, d, page;
  ScaleMode mode;
  bool per_kv;
};

using cuda::DecodeKernel;
using cuda::V1Warps;
using Param = std::tuple<Config, DecodeKernel>;

std::string Name(const ::testing::TestParamInfo<Param>& info) {
  const Config& c = std::get<0>(info.param);
  return KernelName(std::get<1>(info.param)) + "_Hq" + std::to_string(c.hq) + "_Hkv" +
         std::to_string(c.hkv) + "_D" + std::to_string(c.d) + "_P" + std::to_string(c.page) +
         (c.mode == ScaleMode::kPerTokenHead ? "_tokenhead" : "_tensor") +
         (c.per_kv ? "_perkv" : "_shared");
}

class DecodeVsReference : public ::testing::TestWithParam<Param> {};

// Every kernel (v1, v2 with either split) within 2 bf16 ulps of the float64 reference.
TEST_P(DecodeVsReference, EveryElementWithinTwoUlps) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const Config c = std::get<0>(GetParam());
  const DecodeKernel kernel = std::get<1>(GetParam());
  const std::vector<int32_t> lengths = {37, 600, 1500, 3000, c.page, 2100, 1};
  TestCache cache = BuildCache(2, c.hkv, c.d, c.page, c.mode, lengths, 1234 + c.hq + c.d);
  const int topks[] = {1, 7, 16, 100, 511, 512, 513, 1100, 2048, 0, 33, 1025};
  std::vector<RequestSpec> specs;
  for (int i = 0; i < 12; ++i) {
    RequestSpec s;
    s.seq = i % static_cast<int>(lengths.size());
    s.layer = i % 2;
    s.topk = topks[i];
    s.per_kv_head = c.per_kv && (i % 3 != 2);
    s.seed = 77 + i;
    specs.push_back(s);
  }
  TestBatch batch = BuildBatch(cache, c.hq, specs);
  std::vector<uint16_t> out;
  std::vector<float> lse;
  RunGpuDecode(cache, batch, /*with_lse=*/true, &out, &lse, kernel);
  for (int b = 0; b < batch.size(); ++b)
    EXPECT_EQ(CompareWithReference(cache, batch, b, out, lse, 2.0), "") << "topk " << specs[b].topk;

  // The CPU kernels on the same inputs: within 3 ulps of each other.
  std::vector<uint16_t> cpu_out(out.size());
  std::vector<float> cpu_lse(lse.size());
  CpuDecode(cache.HostView(), batch.HostBatch(cpu_out.data(), cpu_lse.data()), nullptr);
  int mismatches = 0;
  for (int row = 0; row < batch.size() * c.hq; ++row) {
    double row_max = 0;
    for (int j = 0; j < c.d; ++j)
      row_max = std::max(row_max, std::fabs(ref::Bf16ToDouble(cpu_out[row * c.d + j])));
    for (int j = 0; j < c.d; ++j) {
      const std::string msg = ref::CheckBf16Close(
          out[row * c.d + j], ref::Bf16ToDouble(cpu_out[row * c.d + j]), 3.0, row_max / 64);
      if (!msg.empty() && mismatches++ < 5)
        ADD_FAILURE() << "vs CPU row " << row << " d " << j << ": " << msg;
    }
  }
  EXPECT_EQ(mismatches, 0);

  // Without lse: the output is the same and nothing else is touched.
  std::vector<uint16_t> out2;
  std::vector<float> lse2;
  RunGpuDecode(cache, batch, /*with_lse=*/false, &out2, &lse2, kernel);
  EXPECT_EQ(0, std::memcmp(out.data(), out2.data(), out.size() * 2));
  for (float x : lse2) EXPECT_TRUE(std::isnan(x));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeVsReference,
    ::testing::Combine(::testing::Values(Config{32, 8, 128, 16, ScaleMode::kPerTensor, false},
                                         Config{32, 8, 128, 16, ScaleMode::kPerTokenHead, true},
                                         Config{8, 4, 128, 64, ScaleMode::kPerTensor, true},
                                         Config{8, 2, 64, 16, ScaleMode::kPerTokenHead, false},
                                         Config{8, 1, 256, 64, ScaleMode::kPerTensor, false},
                                         Config{64, 8, 128, 16, ScaleMode::kPerTokenHead, false},
                                         Config{4, 4, 64, 64, ScaleMode::kPerTensor, true},
                                         Config{32, 2, 128, 16, ScaleMode::kPerTensor, true},
                                         Config{16, 1, 256, 16, ScaleMode::kPerTokenHead, false},
                                         Config{12, 4, 64, 64, ScaleMode::kPerTokenHead, true},
                                         Config{64, 8, 256, 16, ScaleMode::kPerTensor, false},
                                         Config{8, 4, 256, 16, ScaleMode::kPerTokenHead, true},
                                         Config{40, 8, 64, 16, ScaleMode::kPerTensor, false},
                                         // G 7, 9, 10, 11, 13, 15: odd and uneven groups on
                                         // both PV layouts (transposed for G <= 8).
                                         Config{56, 8, 128, 16, ScaleMode::kPerTensor, true},
                                         Config{14, 2, 256, 64, ScaleMode::kPerTokenHead, false},
                                         Config{9, 1, 64, 16, ScaleMode::kPerTensor, false},
                                         Config{20, 2, 128, 64, ScaleMode::kPerTokenHead, true},
                                         Config{44, 4, 64, 16, ScaleMode::kPerTokenHead, false},
                                         Config{13, 1, 128, 16, ScaleMode::kPerTensor, true},
                                         Config{30, 2, 64, 64, ScaleMode::kPerTensor, false},
                                         Config{15, 1, 128, 16, ScaleMode::kPerTokenHead, false}),
                       ::testing::Values(DecodeKernel::kV1, DecodeKernel::kV2Coarse,
                                         DecodeKernel::kV2Fine)),
    Name);

class DecodeBatchInvariance : public ::testing::TestWithParam<DecodeKernel> {};

// A request's bits do not depend on the batch: alone, first of 37, 21st of 37.
TEST_P(DecodeBatchInvariance, AloneFirstAndInsideABatchOf37) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const DecodeKernel kernel = GetParam();
  for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kPerTokenHead}) {
    const std::vector<int32_t> lengths = {4000, 700, 2500, 90};
    TestCache cache = BuildCache(2, 8, 128, 16, mode, lengths, 99);
    RequestSpec target{0, 1, 1700, false, 4242};
    std::vector<RequestSpec> others;
    for (int i = 0; i < 36; ++i)
      others.push_back(RequestSpec{i % 4, i % 2, 1 + (i * 97) % 2048, i % 5 == 0,
                                   static_cast<uint32_t>(500 + i)});
    auto run = [&](const std::vector<RequestSpec>& specs, int at, std::vector<uint16_t>* o,
                   std::vector<float>* l) {
      TestBatch batch = BuildBatch(cache, 32, specs);
      std::vector<uint16_t> out;
      std::vector<float> lse;
      RunGpuDecode(cache, batch, true, &out, &lse, kernel);
      const size_t row = 32 * 128;
      o->assign(out.begin() + at * row, out.begin() + (at + 1) * row);
      l->assign(lse.begin() + at * 32, lse.begin() + (at + 1) * 32);
    };
    std::vector<uint16_t> alone, first, middle, again;
    std::vector<float> lse_alone, lse_first, lse_middle, lse_again;
    run({target}, 0, &alone, &lse_alone);
    std::vector<RequestSpec> b1 = {target};
    b1.insert(b1.end(), others.begin(), others.end());
    run(b1, 0, &first, &lse_first);
    std::vector<RequestSpec> b2(others.begin(), others.begin() + 20);
    b2.push_back(target);
    b2.insert(b2.end(), others.begin() + 20, others.end());
    run(b2, 20, &middle, &lse_middle);
    run(b2, 20, &again, &lse_again);
    EXPECT_EQ(0, std::memcmp(alone.data(), first.data(), alone.size() * 2));
    EXPECT_EQ(0, std::memcmp(alone.data(), middle.data(), alone.size() * 2));
    EXPECT_EQ(0, std::memcmp(middle.data(), again.data(), alone.size() * 2));
    EXPECT_EQ(0, std::memcmp(lse_alone.data(), lse_first.data(), lse_alone.size() * 4));
    EXPECT_EQ(0, std::memcmp(lse_alone.data(), lse_middle.data(), lse_alone.size() * 4));
  }
}

// v2: 1 request (fine split, 2 KV heads per CTA), 8 (fine, 4 heads), 37 (coarse, 2 heads)
// and 256 (coarse, 4 heads) containing it, and the forced splits: the same bits.
TEST_P(DecodeBatchInvariance, OneVersus8And37And256Requests) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const DecodeKernel kernel = GetParam();
  for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kPerTokenHead}) {
    const std::vector<int32_t> lengths = {4000, 700, 2500, 90};
    TestCache cache = BuildCache(1, 8, 128, 16, mode, lengths, 7);
    for (const RequestSpec& target :
         {RequestSpec{0, 0, 1700, false, 4242}, RequestSpec{2, 0, 2048, true, 4243}}) {
      std::vector<RequestSpec> others;
      for (int i = 0; i < 255; ++i)
        others.push_back(RequestSpec{i % 4, 0, 1 + (i * 389) % 2048, i % 7 == 0,
                                     static_cast<uint32_t>(900 + i)});
      auto run = [&](int batch_size, int at, DecodeKernel k, std::vector<uint16_t>* o,
                     std::vector<float>* l) {
        std::vector<RequestSpec> specs(others.begin(), others.begin() + batch_size - 1);
        specs.insert(specs.begin() + at, target);
        TestBatch batch = BuildBatch(cache, 32, specs);
        std::vector<uint16_t> out;
        std::vector<float> lse;
        RunGpuDecode(cache, batch, true, &out, &lse, k);
        const size_t row = 32 * 128;
        o->assign(out.begin() + at * row, out.begin() + (at + 1) * row);
        l->assign(lse.begin() + at * 32, lse.begin() + (at + 1) * 32);
      };
      std::vector<uint16_t> alone, o;
      std::vector<float> lse_alone, l;
      run(1, 0, kernel, &alone, &lse_alone);
      struct Case {
        int size, at;
        DecodeKernel k;
      };
      std::vector<Case> cases = {{8, 5, kernel},
                                 {37, 36, kernel},
                                 {256, 0, kernel},
                                 {256, 131, kernel},
                                 {256, 255, kernel}};
      if (kernel == DecodeKernel::kV2)
        for (DecodeKernel k : {DecodeKernel::kV2Coarse, DecodeKernel::kV2Fine})
          cases.insert(cases.end(), {{1, 0, k}, {8, 3, k}});
      for (const Case& c : cases) {
        run(c.size, c.at, c.k, &o, &l);
        EXPECT_EQ(0, std::memcmp(alone.data(), o.data(), alone.size() * 2))
            << "batch of " << c.size << " at " << c.at << " " << KernelName(c.k);
        EXPECT_EQ(0, std::memcmp(lse_alone.data(), l.data(), l.size() * 4))
            << "lse, batch of " << c.size << " at " << c.at << " " << KernelName(c.k);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, DecodeBatchInvariance,
                         ::testing::Values(DecodeKernel::kV1, DecodeKernel::kV2),
                         [](const ::testing::TestParamInfo<DecodeKernel>& info) {
                           return KernelName(info.param);
                         });

// v1 merges a request's chunks in a cluster (pushed into chunk 0's shared memory) when
// the batch's longest list has 2..8 chunks and the grid has at most one CTA per SM, else
// through the global workspace. Both must give the same bits: a batch of 3 requests (at most 96
// CTAs: cluster on any sm_90 part with 96 SMs or more) either way, and a request alone (4 chunks:
// cluster) or beside a top-K 5000 list (10 chunks: global workspace).
TEST(DecodeClusterMerge, SameBitsAsTheGlobalWorkspace) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const int sms = SmCount();
  if (sms < 96) GTEST_SKIP() << sms << " SMs: the 96-CTA batch would not take the cluster path";
  struct Shape {
    int hq, hkv, d;
    ScaleMode mode;
  };
  for (const Shape sh :
       {Shape{32, 8, 128, ScaleMode::kPerTensor}, Shape{64, 4, 64, ScaleMode::kPerTokenHead},
        Shape{16, 2, 256, ScaleMode::kPerTensor}, Shape{32, 2, 256, ScaleMode::kPerTokenHead}}) {
    SCOPED_TRACE(testing::Message() << sh.hq << "/" << sh.hkv << " D" << sh.d);
    TestCache cache = BuildCache(2, sh.hkv, sh.d, 16, sh.mode, {6000, 700, 2500, 90}, 7);
    const RequestSpec target{0, 1, 1700, false, 4242};
    // 4, 3 and 1 chunks (the one-chunk request's cluster has nothing to merge).
    const std::vector<RequestSpec> specs = {target, RequestSpec{2, 0, 1100, true, 601},
                                            RequestSpec{3, 1, 90, false, 602}};
    auto run = [&](const std::vector<RequestSpec>& batch_specs, DecodeKernel kernel,
                   std::vector<uint16_t>* out, std::vector<float>* lse) {
      TestBatch batch = BuildBatch(cache, sh.hq, batch_specs);
      RunGpuDecode(cache, batch, true, out, lse, kernel);
      if (kernel == DecodeKernel::kV1) {
        for (int b = 0; b < batch.size(); ++b)
          EXPECT_EQ("", CompareWithReference(cache, batch, b, *out, *lse, 2.0)) << "request " << b;
      }
    };
    std::vector<uint16_t> cluster, global, alone, beside;
    std::vector<float> lse_cluster, lse_global, lse_alone, lse_beside;
    run(specs, DecodeKernel::kV1, &cluster, &lse_cluster);
    run(specs, DecodeKernel::kV1GlobalMerge, &global, &lse_global);
    ASSERT_EQ(cluster.size(), global.size());
    EXPECT_EQ(0, std::memcmp(cluster.data(), global.data(), cluster.size() * 2));
    EXPECT_EQ(0, std::memcmp(lse_cluster.data(), lse_global.data(), lse_cluster.size() * 4));
    run({target}, DecodeKernel::kV1, &alone, &lse_alone);
    run({target, RequestSpec{0, 0, 5000, false, 77}}, DecodeKernel::kV1, &beside, &lse_beside);
    const size_t row = static_cast<size_t>(sh.hq) * sh.d;
    EXPECT_EQ(0, std::memcmp(alone.data(), beside.data(), row * 2));
    EXPECT_EQ(0, std::memcmp(lse_alone.data(), lse_beside.data(), sh.hq * 4));
  }
}

// v1 with G <= 8 runs each warp sequence's P*V on a second warp when the grid is small
// (and, with at most one CTA per SM, its QK one step ahead):
// the same bits as one warp per sequence, at every head_dim, in both scale modes and
// index forms, for lists of one and several chunks (cluster and global merges), with -1
// and duplicates, both within 2 ulps of the reference.
TEST(DecodePvWarp, SameBitsAsOneWarpPerSequence) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  for (const Config c : {Config{32, 8, 128, 16, ScaleMode::kPerTensor, false},
                         Config{32, 8, 128, 16, ScaleMode::kPerTokenHead, true},
                         Config{8, 4, 64, 64, ScaleMode::kPerTensor, true},
                         Config{8, 2, 256, 16, ScaleMode::kPerTokenHead, false},
                         Config{8, 1, 128, 64, ScaleMode::kPerTokenHead, true},
                         Config{56, 8, 128, 16, ScaleMode::kPerTensor, false},
                         Config{12, 4, 64, 16, ScaleMode::kPerTokenHead, true},
                         Config{4, 4, 256, 64, ScaleMode::kPerTensor, true},
                         Config{10, 2, 64, 16, ScaleMode::kPerTensor, false}}) {
    SCOPED_TRACE(testing::Message() << c.hq << "/" << c.hkv << " D" << c.d << " page " << c.page
                                    << " mode " << static_cast<int>(c.mode));
    const std::vector<int32_t> lengths = {5000, 700, 2500, 90, c.page + 3};
    TestCache cache = BuildCache(2, c.hkv, c.d, c.page, c.mode, lengths, 4321 + c.hq + c.d);
    const int topks[] = {2048, 1, 16, 100, 513, 0, 1500, 19};
    // 40 requests: more CTAs than SMs at every shape here (asserted below), so both
    // kernels merge split requests through the global workspace (smaller batches:
    // clusters).
    for (int n : {1, 3, 8, 40}) {
      std::vector<RequestSpec> specs;
      for (int i = 0; i < n; ++i)
        specs.push_back(RequestSpec{i % 5, (i + 1) % 2, topks[i % 8], c.per_kv && i % 2 == 0,
                                    static_cast<uint32_t>(60 + i + 10 * n)});
      TestBatch batch = BuildBatch(cache, c.hq, specs);
      if (n == 40) {
        ASSERT_GT(int64_t{n} * c.hkv * cuda::DecodeChunks(batch.max_topk), SmCount());
      }
      // Fused, PV warps, PV warps with QK one step ahead, and both PV kernels reading the
      // request scalars from global memory (no host copies) instead of the launch
      // parameters.
      constexpr int kRuns = 5;
      std::vector<uint16_t> out[kRuns];
      std::vector<float> lse[kRuns];
      const DecodeKernel kernels[kRuns] = {DecodeKernel::kV1Fused, DecodeKernel::kV1PvWarp,
                                           DecodeKernel::kV1PvWarpQkAhead, DecodeKernel::kV1PvWarp,
                                           DecodeKernel::kV1PvWarpQkAhead};
      for (int k = 0; k < kRuns; ++k) {
        RunGpuDecode(cache, batch, true, &out[k], &lse[k], kernels[k], /*host_scalars=*/k < 3);
        for (int b = 0; b < n; ++b)
          EXPECT_EQ("", CompareWithReference(cache, batch, b, out[k], lse[k], 2.0))
              << KernelName(kernels[k]) << " run " << k << ", " << n << " requests, request " << b;
      }
      for (int k = 1; k < kRuns; ++k) {
        ASSERT_EQ(out[0].size(), out[k].size());
        EXPECT_EQ(0, std::memcmp(out[0].data(), out[k].data(), out[0].size() * 2))
            << "run " << k << ", " << n << " requests";
        EXPECT_EQ(0, std::memcmp(lse[0].data(), lse[k].data(), lse[0].size() * 4))
            << "lse, run " << k << ", " << n << " requests";
      }
    }
  }
}

// V1Warps::kAuto (the default) picks PV warps with QK one step ahead while the grid has at
// most one CTA per SM, PV warps while it fits one wave of their CTAs, fused warps above
// (and always for G > 8), at every head_dim and scale mode.
TEST(DecodePvWarp, ChoiceFollowsTheGridSize) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const int sms = SmCount();
  for (int d : {64, 128, 256})
    for (bool per_token : {false, true})
      for (int group : {1, 4, 8, 9, 16}) {
        SCOPED_TRACE(testing::Message() << "D" << d << " G" << group << " per_token " << per_token);
        int per_sm = -1;
        auto choice = [&](int64_t ctas) {
          V1Warps warps = V1Warps::kAuto;
          EXPECT_EQ(cudaSuccess,
                    cuda::DecodePvWarpChoice(d, group, per_token, ctas, &warps, &per_sm));
          return warps;
        };
        if (group > 8) {
          for (int64_t ctas : {1, sms, 100 * sms})
            EXPECT_EQ(V1Warps::kFused, choice(ctas)) << ctas << " CTAs";
          EXPECT_EQ(0, per_sm);
          continue;
        }
        // QK ahead up to one CTA per SM, then PV warps up to one wave of their CTAs.
        EXPECT_EQ(V1Warps::kPvWarpQkAhead, choice(1));
        EXPECT_EQ(V1Warps::kPvWarpQkAhead, choice(sms));
        ASSERT_GE(per_sm, 1);
        const int64_t wave = static_cast<int64_t>(sms) * per_sm;  // of PV-warp CTAs
        if (per_sm >= 2) {
          EXPECT_EQ(V1Warps::kPvWarp, choice(sms + 1)) << per_sm << " PV CTAs per SM";
          EXPECT_EQ(V1Warps::kPvWarp, choice(wave)) << per_sm << " PV CTAs per SM";
        }
        EXPECT_EQ(V1Warps::kFused, choice(wave + 1)) << per_sm << " PV CTAs per SM";
        // What an sm_90 SM (228 KB shared memory, 64K registers) holds of the PV-warp
        // instances, pinned so that the rule cannot follow the wrong instance's
        // occupancy unnoticed: head_dim 64 at least two, 128 two (the 8-request case of
        // the bench), 256 one.
        if (d == 64) {
          EXPECT_GE(per_sm, 2);
        } else {
          EXPECT_EQ(d == 128 ? 2 : 1, per_sm);
        }
      }
  V1Warps warps = V1Warps::kAuto;
  EXPECT_EQ(cudaErrorInvalidValue, cuda::DecodePvWarpChoice(96, 4, false, 1, &warps));
}

// v1 takes the per-request scalars (top-K, layer, offsets, index form) of batches of at
// most DecodeInlineRequests() requests from its launch parameters when the caller passes
// the host copies: within 2 ulps of the reference and the same bits as reading them from
// global memory, at the limit and one above it (which must fall back to global memory).
TEST(DecodeInlineScalars, SameBitsAsGlobalMemory) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  const int limit = cuda::DecodeInlineRequests();
  for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kPerTokenHead}) {
    TestCache cache = BuildCache(3, 4, 128, 16, mode, {3000, 40, 1200, 700, 5}, 31);
    for (int n : {1, limit, limit + 1}) {
      SCOPED_TRACE(testing::Message()
                   << "mode " << static_cast<int>(mode) << ", " << n << " requests");
      std::vector<RequestSpec> specs;
      for (int i = 0; i < n; ++i)
        specs.push_back(RequestSpec{(i + 1) % 5, (2 * i + 1) % 3,
                                    i % 6 == 5 ? 0 : 1 + (i * 613 + 700) % 2100, i % 3 == 1,
                                    static_cast<uint32_t>(300 + i)});
      TestBatch batch = BuildBatch(cache, 16, specs);
      std::vector<uint16_t> in_params, in_global;
      std::vector<float> lse_params, lse_global;
      RunGpuDecode(cache, batch, true, &in_params, &lse_params, DecodeKernel::kV1, true);
      RunGpuDecode(cache, batch, true, &in_global, &lse_global, DecodeKernel::kV1, false);
      for (int b = 0; b < n; ++b)
        EXPECT_EQ("", CompareWithReference(cache, batch, b, in_params, lse_params, 2.0))
            << "request " << b;
      EXPECT_EQ(0, std::memcmp(in_params.data(), in_global.data(), in_params.size() * 2));
      EXPECT_EQ(0, std::memcmp(lse_params.data(), lse_global.data(), lse_params.size() * 4));
      // Host copies that say top-K 0 everywhere: a batch that takes its scalars from the
      // parameters attends to nothing (every output +0), one above the limit ignores them.
      const std::vector<int32_t> no_indices(n, 0);
      DecodeBatch lying = batch.HostBatch(nullptr, nullptr);
      lying.topk = no_indices.data();
      std::vector<uint16_t> out_lying;
      std::vector<float> lse_lying;
      RunGpuDecode(cache, batch, true, &out_lying, &lse_lying, DecodeKernel::kV1, true, &lying);
      if (n <= limit) {
        EXPECT_TRUE(std::all_of(out_lying.begin(), out_lying.end(), [](uint16_t x) {
          return x == 0;
        })) << "the kernel did not take top-K from its parameters";
      } else {
        EXPECT_EQ(0, std::memcmp(out_lying.data(), in_global.data(), in_global.size() * 2))
            << "above the limit the kernel must read global memory";
      }
    }
  }
}

}  // namespace
}  // namespace sds::gputest
