// Shared-index requests run as multi-KV-head work items (one row list, whole token
// slots prefetched); per-KV-head lists run head by head. Replicating a shared list
// once per KV head must give the same output bits, on every path, at batch sizes that
// put 1, 2, 4 or all 8 KV heads in one work item.
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_attention.h"
#include "tests/reference/fresh_seed.h"
#include "tests/unit_kernels/test_batch.h"

namespace sds {
namespace {

class SharedIndexTest : public ::testing::TestWithParam<CpuKernelPath> {};

TEST_P(SharedIndexTest, SharedListEqualsReplicatedPerKvHeadLists) {
  for (int batch_size : {1, 2, 3, 9}) {
    const uint32_t seed = test::FreshSeed();
    SCOPED_TRACE("seed " + std::to_string(seed) + " batch " + std::to_string(batch_size));
    test::BatchSpec spec;
    spec.num_q_heads = 32;
    spec.num_kv_heads = 8;
    spec.head_dim = 128;
    spec.batch_size = batch_size;
    spec.min_topk = 1;
    spec.max_topk = 150;
    spec.per_kv_head_mode = 0;  // shared lists
    spec.scale_mode = seed % 2 ? ScaleMode::kPerTokenHead : ScaleMode::kPerTensor;
    test::TestBatch shared = test::BuildBatch(spec, seed);
    test::TestBatch replicated = test::BuildBatch(spec, seed);
    // replicated: every request's list [K_b] becomes [Hkv, K_b], the same list per head.
    std::vector<int32_t> indices;
    for (int b = 0; b < batch_size; ++b) {
      replicated.index_offset[b] = static_cast<int64_t>(indices.size());
      replicated.indices_per_kv_head[b] = 1;
      const int32_t* list = shared.indices.data() + shared.index_offset[b];
      for (int h = 0; h < spec.num_kv_heads; ++h)
        indices.insert(indices.end(), list, list + shared.topk[b]);
    }
    replicated.indices = indices;
    shared.Poison();
    replicated.Poison();
    CpuThreadPool pool(2);
    CpuDecode(shared.cache.view(), shared.view(), &pool, GetParam());
    CpuDecode(replicated.cache.view(), replicated.view(), &pool, GetParam());
    ASSERT_EQ(shared.out, replicated.out);
    ASSERT_EQ(shared.lse, replicated.lse);
    for (int b = 0; b < batch_size; ++b) {
      const std::string failures = test::CompareWithReference(shared, b);
      ASSERT_TRUE(failures.empty()) << failures;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, SharedIndexTest,
                         ::testing::Values(CpuKernelPath::kPortable, CpuKernelPath::kAvx2,
                                           CpuKernelPath::kAvx512Bf16),
                         [](const auto& info) { return test::CpuKernelPathName(info.param); });

}  // namespace
}  // namespace sds
