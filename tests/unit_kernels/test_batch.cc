#include "tests/unit_kernels/test_batch.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "kernels/cpu_append.h"
#include "kernels/fp8.h"
#include "tests/reference/reference_decode.h"

namespace sds::test {

std::string CpuKernelPathName(CpuKernelPath path) {
  switch (path) {
    case CpuKernelPath::kPortable:
      return "portable";
    case CpuKernelPath::kAvx2:
      return "avx2";
    case CpuKernelPath::kAvx512Bf16:
      return "avx512bf16";
    case CpuKernelPath::kAuto:
      break;
  }
  return "auto";
}

CacheView HostCache::view() {
  CacheView view;
  view.geo = geo;
  view.k = k.data();
  view.v = v.data();
  if (geo.scale_mode == ScaleMode::kPerTokenHead) {
    view.k_token_scale = k_token_scale.data();
    view.v_token_scale = v_token_scale.data();
  } else {
    view.layer_k_scale = layer_k_scale.data();
    view.layer_v_scale = layer_v_scale.data();
  }
  return view;
}

DecodeBatch TestBatch::view() {
  DecodeBatch batch;
  batch.num_requests = num_requests;
  batch.num_q_heads = num_q_heads;
  batch.q = q.data();
  batch.gate = gate.data();
  batch.layer = layer.data();
  batch.page_table = page_table.data();
  batch.page_table_offset = page_table_offset.data();
  batch.indices = indices.data();
  batch.index_offset = index_offset.data();
  batch.topk = topk.data();
  batch.indices_per_kv_head = indices_per_kv_head.data();
  batch.out = out.data();
  batch.lse = lse.data();
  return batch;
}

void TestBatch::Poison() {
  std::fill(out.begin(), out.end(), uint16_t{0x7FC1});
  std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
}

namespace {

std::vector<uint16_t> RandomBf16(size_t count, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<uint16_t> values(count);
  for (uint16_t& value : values) value = FloatToBf16(normal(rng));
  return values;
}

// Writes `length` random tokens of every layer of one sequence through CpuAppend.
void FillSequence(HostCache& cache, const std::vector<int32_t>& pages, int32_t length,
                  float magnitude, std::mt19937& rng) {
  const CacheGeometry& geo = cache.geo;
  const size_t row_elements = static_cast<size_t>(geo.num_kv_heads) * geo.head_dim;
  for (int32_t layer = 0; layer < geo.num_layers; ++layer) {
    std::vector<uint16_t> k_new = RandomBf16(length * row_elements, magnitude, rng);
    std::vector<uint16_t> v_new = RandomBf16(length * row_elements, magnitude, rng);
    std::vector<int32_t> layers(length, layer);
    std::vector<int64_t> slots(length);
    for (int32_t t = 0; t < length; ++t)
      slots[t] = static_cast<int64_t>(pages[t / geo.page_size]) * geo.page_size + t % geo.page_size;
    AppendBatch append{length, k_new.data(), v_new.data(), layers.data(), slots.data()};
    CpuAppend(cache.view(), append);
  }
}

}  // namespace

TestBatch BuildBatch(const BatchSpec& spec, uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  TestBatch batch;
  batch.num_requests = spec.batch_size;
  batch.num_q_heads = spec.num_q_heads;
  const int32_t page_size = spec.page_size;

  std::vector<int32_t> lengths(spec.batch_size);
  int64_t total_pages = 1;  // one page nobody owns, to catch stray reads of page 0
  for (int32_t& length : lengths) {
    length = uniform(spec.min_length, spec.max_length);
    total_pages += (length + page_size - 1) / page_size;
  }
  CacheGeometry& geo = batch.cache.geo;
  geo = CacheGeometry{spec.num_layers, spec.num_kv_heads, spec.head_dim,
                      page_size,       total_pages,       spec.scale_mode};
  HostCache& cache = batch.cache;
  cache.k.assign(geo.num_layers * geo.LayerElements(), 0);
  cache.v.assign(geo.num_layers * geo.LayerElements(), 0);
  cache.k_token_scale.assign(geo.num_layers * geo.LayerScales(), 0.0f);
  cache.v_token_scale.assign(geo.num_layers * geo.LayerScales(), 0.0f);
  std::uniform_real_distribution<float> scale_factor(2.0f, 4.0f);
  for (int32_t layer = 0; layer < geo.num_layers; ++layer) {
    // per_tensor: scales such that |x| up to ~3 sigma fit into +-448 (larger ones saturate).
    const float boost = spec.layer_scale_boost;
    cache.layer_k_scale.push_back(spec.kv_magnitude * scale_factor(rng) * boost / 448.0f);
    cache.layer_v_scale.push_back(spec.kv_magnitude * scale_factor(rng) * boost / 448.0f);
  }

  std::vector<int32_t> page_order(total_pages);
  std::iota(page_order.begin(), page_order.end(), 0);
  std::shuffle(page_order.begin(), page_order.end(), rng);
  size_t next_page = 1;
  const size_t head_elements = static_cast<size_t>(spec.num_q_heads) * spec.head_dim;
  for (int32_t b = 0; b < spec.batch_size; ++b) {
    const int32_t length = lengths[b];
    std::vector<int32_t> pages(
        page_order.begin() + next_page,
        page_order.begin() + next_page + (length + page_size - 1) / page_size);
    next_page += pages.size();
    FillSequence(cache, pages, length, spec.kv_magnitude, rng);
    batch.page_table_offset.push_back(batch.page_table.size());
    batch.page_table.insert(batch.page_table.end(), pages.begin(), pages.end());
    batch.layer.push_back(uniform(0, spec.num_layers - 1));

    const int32_t topk = uniform(spec.min_topk, spec.max_topk);
    const bool per_kv_head =
        spec.per_kv_head_mode == 2 ? uniform(0, 1) == 1 : spec.per_kv_head_mode;
    batch.topk.push_back(topk);
    batch.indices_per_kv_head.push_back(per_kv_head ? 1 : 0);
    batch.index_offset.push_back(batch.indices.size());
    std::uniform_real_distribution<double> coin(0.0, 1.0);
    for (int list = 0; list < (per_kv_head ? spec.num_kv_heads : 1); ++list) {
      std::vector<int32_t> chosen;
      for (int32_t i = 0; i < topk; ++i) {
        const double draw = coin(rng);
        if (draw < spec.skip_fraction) {
          chosen.push_back(-1);
        } else if (draw < spec.skip_fraction + spec.duplicate_fraction && !chosen.empty()) {
          chosen.push_back(chosen[uniform(0, static_cast<int>(chosen.size()) - 1)]);
        } else {
          chosen.push_back(uniform(0, length - 1));
        }
      }
      batch.indices.insert(batch.indices.end(), chosen.begin(), chosen.end());
    }
    std::vector<uint16_t> q = RandomBf16(head_elements, spec.q_magnitude, rng);
    std::vector<uint16_t> gate = RandomBf16(head_elements, 2.0f, rng);
    batch.q.insert(batch.q.end(), q.begin(), q.end());
    batch.gate.insert(batch.gate.end(), gate.begin(), gate.end());
  }
  batch.out.assign(spec.batch_size * head_elements, 0);
  batch.lse.assign(static_cast<size_t>(spec.batch_size) * spec.num_q_heads, 0.0f);
  batch.Poison();
  return batch;
}

std::string CompareWithReference(TestBatch& batch, int32_t b, double ulps) {
  const CacheView cache = batch.cache.view();
  const DecodeBatch view = batch.view();
  const ref::RowResult want = ref::ReferenceDecode(cache, view, b);
  const int hq = batch.num_q_heads, d = cache.geo.head_dim;
  std::ostringstream failures;
  int failure_count = 0;
  for (int h = 0; h < hq; ++h) {
    for (int j = 0; j < d; ++j) {
      const uint16_t got = batch.out[(static_cast<size_t>(b) * hq + h) * d + j];
      std::string problem =
          got == 0x7FC1 ? "never written" : ref::CheckOutputElement(want, h, j, d, got, ulps);
      if (!problem.empty() && failure_count++ < 5)
        failures << "out[b=" << b << "][h=" << h << "][" << j << "]: " << problem << "\n";
    }
    const double got_lse = batch.lse[static_cast<size_t>(b) * hq + h];
    const double want_lse = want.lse[h];
    const bool lse_ok = std::isinf(want_lse) ? (std::isinf(got_lse) && got_lse < 0)
                                             : std::fabs(got_lse - want_lse) <=
                                                   1e-4 * std::max(1.0, std::fabs(want_lse));
    if (!lse_ok && failure_count++ < 5)
      failures << "lse[b=" << b << "][h=" << h << "]: got " << got_lse << " want " << want_lse
               << "\n";
  }
  if (failure_count > 5) failures << "... " << failure_count << " failures in all\n";
  return failures.str();
}

}  // namespace sds::test
