// A request's output bits depend only on its own inputs: alone, inside a batch of 37
// others, at another place in the batch, and with any number of threads.
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_attention.h"
#include "tests/reference/fresh_seed.h"
#include "tests/unit_kernels/test_batch.h"

namespace sds {
namespace {

struct Outputs {
  std::vector<uint16_t> out;  // [B', Hq, D] in the order of `order`
  std::vector<float> lse;     // [B', Hq]
};

// Runs the requests `order` (indices into `batch`) as one batch of their own.
Outputs RunSubset(test::TestBatch& batch, const std::vector<int>& order, CpuThreadPool* pool,
                  CpuKernelPath path) {
  const DecodeBatch full = batch.view();
  const int hq = batch.num_q_heads, d = batch.cache.geo.head_dim;
  const size_t head_elements = static_cast<size_t>(hq) * d;
  std::vector<uint16_t> q, gate;
  std::vector<int32_t> layer, topk;
  std::vector<int64_t> page_table_offset, index_offset;
  std::vector<uint8_t> per_kv_head;
  for (int b : order) {
    q.insert(q.end(), batch.q.begin() + b * head_elements,
             batch.q.begin() + (b + 1) * head_elements);
    gate.insert(gate.end(), batch.gate.begin() + b * head_elements,
                batch.gate.begin() + (b + 1) * head_elements);
    layer.push_back(batch.layer[b]);
    topk.push_back(batch.topk[b]);
    page_table_offset.push_back(batch.page_table_offset[b]);
    index_offset.push_back(batch.index_offset[b]);
    per_kv_head.push_back(batch.indices_per_kv_head[b]);
  }
  Outputs result;
  result.out.assign(order.size() * head_elements, 0x7FC1);
  result.lse.assign(order.size() * hq, std::numeric_limits<float>::quiet_NaN());
  DecodeBatch subset = full;
  subset.num_requests = static_cast<int32_t>(order.size());
  subset.q = q.data();
  subset.gate = gate.data();
  subset.layer = layer.data();
  subset.topk = topk.data();
  subset.page_table_offset = page_table_offset.data();
  subset.index_offset = index_offset.data();
  subset.indices_per_kv_head = per_kv_head.data();
  subset.out = result.out.data();
  subset.lse = result.lse.data();
  CpuDecode(batch.cache.view(), subset, pool, path);
  return result;
}

// Request `position` of `outputs`, as raw bits.
std::vector<uint16_t> OutOf(const Outputs& outputs, int position, size_t head_elements) {
  return {outputs.out.begin() + position * head_elements,
          outputs.out.begin() + (position + 1) * head_elements};
}
std::vector<float> LseOf(const Outputs& outputs, int position, int hq) {
  return {outputs.lse.begin() + position * hq, outputs.lse.begin() + (position + 1) * hq};
}

class BatchInvarianceTest : public ::testing::TestWithParam<CpuKernelPath> {};

TEST_P(BatchInvarianceTest, OutputBitsIndependentOfBatch) {
  const uint32_t seed = test::FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  test::BatchSpec spec;
  spec.num_q_heads = 32;
  spec.num_kv_heads = 8;
  spec.head_dim = 128;
  spec.batch_size = 38;
  spec.min_length = 50;
  spec.max_length = 400;
  spec.min_topk = 1;
  spec.max_topk = 300;
  spec.scale_mode = seed % 2 ? ScaleMode::kPerTokenHead : ScaleMode::kPerTensor;
  test::TestBatch batch = test::BuildBatch(spec, seed);
  const size_t head_elements = static_cast<size_t>(spec.num_q_heads) * spec.head_dim;
  CpuThreadPool pool(2);

  std::vector<int> all(spec.batch_size);
  std::iota(all.begin(), all.end(), 0);
  std::vector<int> shuffled = all;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(seed + 1));
  const Outputs in_batch = RunSubset(batch, all, &pool, GetParam());
  const Outputs in_shuffled = RunSubset(batch, shuffled, &pool, GetParam());
  const Outputs single_thread = RunSubset(batch, all, nullptr, GetParam());

  for (int b = 0; b < spec.batch_size; ++b) {
    SCOPED_TRACE("request " + std::to_string(b));
    const Outputs alone = RunSubset(batch, {b}, &pool, GetParam());
    const int shuffled_position =
        static_cast<int>(std::find(shuffled.begin(), shuffled.end(), b) - shuffled.begin());
    const std::vector<uint16_t> want_out = OutOf(alone, 0, head_elements);
    const std::vector<float> want_lse = LseOf(alone, 0, spec.num_q_heads);
    ASSERT_EQ(OutOf(in_batch, b, head_elements), want_out);
    ASSERT_EQ(OutOf(in_shuffled, shuffled_position, head_elements), want_out);
    ASSERT_EQ(OutOf(single_thread, b, head_elements), want_out);
    // lse compared as bits via memcmp semantics of == on floats (none are NaN).
    ASSERT_EQ(LseOf(in_batch, b, spec.num_q_heads), want_lse);
    ASSERT_EQ(LseOf(in_shuffled, shuffled_position, spec.num_q_heads), want_lse);
    ASSERT_EQ(LseOf(single_thread, b, spec.num_q_heads), want_lse);
    // And the result is right, not merely stable.
    std::copy(want_out.begin(), want_out.end(), batch.out.begin() + b * head_elements);
    std::copy(want_lse.begin(), want_lse.end(), batch.lse.begin() + b * spec.num_q_heads);
    const std::string failures = test::CompareWithReference(batch, b);
    ASSERT_TRUE(failures.empty()) << failures;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, BatchInvarianceTest,
                         ::testing::Values(CpuKernelPath::kPortable, CpuKernelPath::kAvx2,
                                           CpuKernelPath::kAvx512Bf16),
                         [](const auto& info) { return test::CpuKernelPathName(info.param); });

}  // namespace
}  // namespace sds
