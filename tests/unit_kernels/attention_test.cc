// CpuDecode against the float64 reference (sds::ref::ReferenceDecode) on fresh random
// inputs: every output element must pass, for both kernel paths.
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>

#include "gtest/gtest.h"
#include "kernels/cpu_attention.h"
#include "tests/reference/fresh_seed.h"
#include "tests/unit_kernels/test_batch.h"

namespace sds {
namespace {

using test::BatchSpec;
using test::FreshSeed;
using test::TestBatch;

const char* PathName(CpuKernelPath path) {
  switch (path) {
    case CpuKernelPath::kPortable:
      return "portable";
    case CpuKernelPath::kAvx2:
      return "avx2";
    case CpuKernelPath::kAvx512Bf16:
      return "avx512bf16";
    default:
      return "auto";
  }
}

// Builds a batch from `spec`, runs CpuDecode on poisoned outputs, checks every request.
void RunAndCheck(const BatchSpec& spec, CpuKernelPath path, uint32_t seed, CpuThreadPool* pool) {
  SCOPED_TRACE(std::string("seed ") + std::to_string(seed) + " path " + PathName(path));
  TestBatch batch = BuildBatch(spec, seed);
  batch.Poison();
  CpuDecode(batch.cache.view(), batch.view(), pool, path);
  for (int32_t b = 0; b < batch.num_requests; ++b) {
    const std::string failures = test::CompareWithReference(batch, b);
    ASSERT_TRUE(failures.empty()) << failures;
  }
}

CpuThreadPool& SharedPool() {
  static CpuThreadPool pool(2);
  return pool;
}

// (Hq, Hkv), D, page size, scale mode, kernel path.
using ShapeParam = std::tuple<std::pair<int, int>, int, int, ScaleMode, CpuKernelPath>;

class CpuDecodeShapeTest : public ::testing::TestWithParam<ShapeParam> {};

TEST_P(CpuDecodeShapeTest, MatchesReference) {
  const auto& [heads, head_dim, page_size, mode, path] = GetParam();
  BatchSpec spec;
  spec.num_q_heads = heads.first;
  spec.num_kv_heads = heads.second;
  spec.head_dim = head_dim;
  spec.page_size = page_size;
  spec.scale_mode = mode;
  spec.batch_size = 3;
  spec.max_length = 150;
  spec.max_topk = 70;
  RunAndCheck(spec, path, FreshSeed(), &SharedPool());
}

std::string ShapeName(const ::testing::TestParamInfo<ShapeParam>& info) {
  const auto& [heads, head_dim, page_size, mode, path] = info.param;
  return std::to_string(heads.first) + "q" + std::to_string(heads.second) + "kv_d" +
         std::to_string(head_dim) + "_p" + std::to_string(page_size) +
         (mode == ScaleMode::kPerTensor ? "_tensor_" : "_tokenhead_") + PathName(path);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuDecodeShapeTest,
    ::testing::Combine(::testing::Values(std::pair{32, 8}, std::pair{8, 4}, std::pair{8, 2},
                                         std::pair{8, 1}, std::pair{64, 8}, std::pair{4, 4}),
                       ::testing::Values(64, 128, 256), ::testing::Values(16, 64),
                       ::testing::Values(ScaleMode::kPerTensor, ScaleMode::kPerTokenHead),
                       ::testing::Values(CpuKernelPath::kPortable, CpuKernelPath::kAvx2,
                                         CpuKernelPath::kAvx512Bf16)),
    ShapeName);

class CpuDecodeCaseTest : public ::testing::TestWithParam<CpuKernelPath> {};

// K from 1 to 2048 with -1 padding and duplicates, indices crossing page boundaries.
TEST_P(CpuDecodeCaseTest, TopKSweep) {
  for (int topk : {1, 2, 7, 8, 9, 15, 16, 17, 63, 100, 257, 512, 1000, 2048}) {
    SCOPED_TRACE("topk " + std::to_string(topk));
    BatchSpec spec;
    spec.num_q_heads = 8;
    spec.num_kv_heads = 2;
    spec.head_dim = 128;
    spec.page_size = 16;
    spec.batch_size = 3;
    spec.min_length = std::max(1, topk / 2);
    spec.max_length = topk + 40;
    spec.min_topk = spec.max_topk = topk;
    spec.skip_fraction = 0.15;
    spec.duplicate_fraction = 0.15;
    spec.scale_mode = topk % 2 ? ScaleMode::kPerTokenHead : ScaleMode::kPerTensor;
    RunAndCheck(spec, GetParam(), FreshSeed(), &SharedPool());
  }
}

TEST_P(CpuDecodeCaseTest, PerKvHeadIndices) {
  BatchSpec spec;
  spec.num_q_heads = 32;
  spec.num_kv_heads = 8;
  spec.head_dim = 64;
  spec.batch_size = 5;
  spec.max_topk = 300;
  spec.per_kv_head_mode = 1;
  RunAndCheck(spec, GetParam(), FreshSeed(), &SharedPool());
  spec.scale_mode = ScaleMode::kPerTokenHead;
  spec.num_kv_heads = 2;
  spec.num_q_heads = 8;
  RunAndCheck(spec, GetParam(), FreshSeed(), &SharedPool());
}

TEST_P(CpuDecodeCaseTest, OddBatchSizesWithoutPool) {
  for (int batch_size : {1, 7, 13}) {
    BatchSpec spec;
    spec.batch_size = batch_size;
    spec.num_q_heads = 8;
    spec.num_kv_heads = 4;
    spec.max_topk = 90;
    RunAndCheck(spec, GetParam(), FreshSeed(), nullptr);
  }
}

// Scores around 1e4: exp without max subtraction overflows to inf.
TEST_P(CpuDecodeCaseTest, LargeMagnitudeScores) {
  for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kPerTokenHead}) {
    BatchSpec spec;
    spec.num_q_heads = 8;
    spec.num_kv_heads = 2;
    spec.head_dim = 128;
    spec.scale_mode = mode;
    spec.batch_size = 3;
    spec.min_topk = 20;
    spec.max_topk = 200;
    spec.q_magnitude = 4000.0f;
    const uint32_t seed = FreshSeed();
    RunAndCheck(spec, GetParam(), seed, &SharedPool());
    // The premise: some scores really reach ~1e4 (lse well above float exp's range).
    TestBatch batch = BuildBatch(spec, seed);
    CpuDecode(batch.cache.view(), batch.view(), nullptr, GetParam());
    float max_lse = 0;
    for (float value : batch.lse) max_lse = std::max(max_lse, value);
    EXPECT_GT(max_lse, 1000.0f) << "seed " << seed;
  }
}

// Head dims that select the narrower kernels (D % 32 != 0 or D % 16 != 0) and group
// sizes without a dedicated tile (3, 16).
TEST_P(CpuDecodeCaseTest, UnusualShapes) {
  for (auto [hq, hkv, d] : {std::tuple{8, 2, 16}, std::tuple{8, 2, 48}, std::tuple{8, 4, 96},
                            std::tuple{12, 4, 64}, std::tuple{32, 2, 32}, std::tuple{6, 2, 8}}) {
    SCOPED_TRACE("hq " + std::to_string(hq) + " hkv " + std::to_string(hkv) + " d " +
                 std::to_string(d));
    BatchSpec spec;
    spec.num_q_heads = hq;
    spec.num_kv_heads = hkv;
    spec.head_dim = d;
    spec.batch_size = 3;
    spec.max_topk = 80;
    RunAndCheck(spec, GetParam(), FreshSeed(), &SharedPool());
  }
}

// Almost every stored code is an FP8 subnormal (|x / scale| < 2^-6): the bf16 dot
// product path must not flush them.
TEST_P(CpuDecodeCaseTest, SubnormalCodes) {
  BatchSpec spec;
  spec.num_q_heads = 8;
  spec.num_kv_heads = 2;
  spec.head_dim = 128;
  spec.batch_size = 3;
  spec.max_topk = 100;
  spec.layer_scale_boost = 40000.0f;  // |x / scale| ~ 0.004 |x|: codes 0..8
  const uint32_t seed = FreshSeed();
  RunAndCheck(spec, GetParam(), seed, &SharedPool());
  TestBatch batch = BuildBatch(spec, seed);
  int subnormal = 0, zero = 0;
  for (uint8_t code : batch.cache.k) {
    if ((code & 0x78) == 0 && (code & 0x07) != 0) ++subnormal;
    if ((code & 0x7F) == 0) ++zero;
  }
  EXPECT_GT(subnormal, 10 * (static_cast<int>(batch.cache.k.size()) - subnormal - zero))
      << "seed " << seed;
}

// Rows whose indices are all -1 (or K == 0) give out == 0 exactly and lse == -inf.
TEST_P(CpuDecodeCaseTest, RowsWithoutValidIndex) {
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  BatchSpec spec;
  spec.num_q_heads = 8;
  spec.num_kv_heads = 2;
  spec.batch_size = 4;
  spec.min_topk = 5;
  spec.max_topk = 40;
  spec.per_kv_head_mode = 1;
  TestBatch batch = BuildBatch(spec, seed);
  // Request 1: every list all -1. Request 2: only KV head 1's list all -1. Request 3: K = 0.
  for (int64_t i = batch.index_offset[1]; i < batch.index_offset[2]; ++i) batch.indices[i] = -1;
  const int64_t half = (batch.index_offset[3] - batch.index_offset[2]) / 2;
  for (int64_t i = batch.index_offset[2] + half; i < batch.index_offset[3]; ++i)
    batch.indices[i] = -1;
  batch.topk[3] = 0;
  batch.Poison();
  CpuDecode(batch.cache.view(), batch.view(), &SharedPool(), GetParam());
  const int d = spec.head_dim;
  auto expect_empty = [&](int b, int h) {
    for (int j = 0; j < d; ++j)
      ASSERT_EQ(batch.out[(b * spec.num_q_heads + h) * d + j], 0) << b << " " << h << " " << j;
    const float lse = batch.lse[b * spec.num_q_heads + h];
    ASSERT_TRUE(std::isinf(lse) && lse < 0) << b << " " << h << " lse " << lse;
  };
  for (int h = 0; h < spec.num_q_heads; ++h) expect_empty(1, h);
  for (int h = 4; h < 8; ++h) expect_empty(2, h);
  for (int h = 0; h < spec.num_q_heads; ++h) expect_empty(3, h);
  for (int b = 0; b < 4; ++b) {
    const std::string failures = test::CompareWithReference(batch, b);
    ASSERT_TRUE(failures.empty()) << failures;
  }
}

// lse == nullptr is allowed.
TEST_P(CpuDecodeCaseTest, WithoutLse) {
  const uint32_t seed = FreshSeed();
  BatchSpec spec;
  TestBatch with_lse = BuildBatch(spec, seed);
  TestBatch without_lse = BuildBatch(spec, seed);
  CpuDecode(with_lse.cache.view(), with_lse.view(), &SharedPool(), GetParam());
  DecodeBatch view = without_lse.view();
  view.lse = nullptr;
  CpuDecode(without_lse.cache.view(), view, &SharedPool(), GetParam());
  EXPECT_EQ(with_lse.out, without_lse.out) << "seed " << seed;
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuDecodeCaseTest,
                         ::testing::Values(CpuKernelPath::kPortable, CpuKernelPath::kAvx2,
                                           CpuKernelPath::kAvx512Bf16),
                         [](const auto& info) { return std::string(PathName(info.param)); });

}  // namespace
}  // namespace sds
