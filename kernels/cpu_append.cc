#include "kernels/cpu_append.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

#include "kernels/fp8.h"

namespace sds {
namespace {

// Quantises one row. row: [D] bf16 bits; codes: [D] FP8 bytes out; token_scale: one
// float out (per_token_head) or nullptr (per_tensor, using layer_scale).
void QuantiseRow(const uint16_t* row, int head_dim, float layer_scale, uint8_t* codes,
                 float* token_scale) {
  float scale = layer_scale;
  if (token_scale != nullptr) {
    float max_abs = 0.0f;
    for (int j = 0; j < head_dim; ++j) max_abs = std::fmax(max_abs, std::fabs(Bf16ToFloat(row[j])));
    scale = PerTokenHeadScale(max_abs);
    *token_scale = scale;
  }
  for (int j = 0; j < head_dim; ++j) codes[j] = QuantiseFp8E4m3(Bf16ToFloat(row[j]), scale);
}

#if defined(__x86_64__)
#if defined(__GNUC__)
// GCC 12's AVX-512 intrinsics trip -Wmaybe-uninitialized on their own undefined
// pass-through operand (GCC PR 105593), as in cpu_attention_avx512.cc.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// 16 bf16 values at `row` -> floats (exact).
__attribute__((target("avx512f,avx512bw"))) inline __m512 LoadBf16x16(const uint16_t* row) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// QuantiseRow for D % 16 == 0 with AVX-512F/BW, 16 elements at a time; the same bits as
// FloatToFp8E4m3(x / scale) (tests/unit_kernels/append_test.cc checks every finite bf16
// input): the same IEEE division, the normal codes by the same add-and-shift rounding,
// the subnormal codes as round-to-nearest-even of |y| * 2^9 (an exact product).
__attribute__((target("avx512f,avx512bw"))) void QuantiseRowAvx512(const uint16_t* row,
                                                                   int head_dim, float layer_scale,
                                                                   uint8_t* codes,
                                                                   float* token_scale) {
  float scale = layer_scale;
  if (token_scale != nullptr) {
    __m512 max_abs = _mm512_setzero_ps();  // max is exact in any order
    for (int j = 0; j < head_dim; j += 16)
      max_abs = _mm512_max_ps(max_abs, _mm512_abs_ps(LoadBf16x16(row + j)));
    scale = PerTokenHeadScale(_mm512_reduce_max_ps(max_abs));
    *token_scale = scale;
  }
  const __m512 divisor = _mm512_set1_ps(scale);
  const __m512i one = _mm512_set1_epi32(1);
  for (int j = 0; j < head_dim; j += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_div_ps(LoadBf16x16(row + j), divisor));
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __m512i exponent = _mm512_srli_epi32(magnitude, 23);
    // |y| >= 2^-6: ShiftRightRoundEven(magnitude, 20) - (120 << 3).
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, 20), one);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(magnitude, _mm512_set1_epi32(0x7FFFF)), odd), 20);
    const __m512i normal = _mm512_sub_epi32(rounded, _mm512_set1_epi32(960));
    // |y| < 2^-6: round(|y| / 2^-9), ties to even.
    const __m512i subnormal = _mm512_cvt_roundps_epi32(
        _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(512.0f)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 is_normal = _mm512_cmpge_epu32_mask(exponent, _mm512_set1_epi32(121));
    __m512i code = _mm512_mask_blend_epi32(is_normal, subnormal, normal);
    code = _mm512_min_epu32(code, _mm512_set1_epi32(0x7E));  // saturate (also inf)
    const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F800000));
    code = _mm512_mask_mov_epi32(code, is_nan, _mm512_set1_epi32(0x7F));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j),
                     _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
  }
}

bool Avx512RowsSupported(int head_dim) {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return cpu && head_dim % 16 == 0;
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif

}  // namespace

void CpuAppend(const CacheView& cache, const AppendBatch& append) {
  const CacheGeometry& geo = cache.geo;
  const int num_kv_heads = geo.num_kv_heads;
  const int head_dim = geo.head_dim;
  const bool per_token_head = geo.scale_mode == ScaleMode::kPerTokenHead;
  auto* quantise = &QuantiseRow;
#if defined(__x86_64__)
  if (Avx512RowsSupported(head_dim)) quantise = &QuantiseRowAvx512;
#endif
  // The new tokens' slots are scattered over the cache and cold: request every line to
  // be written first (a batch's stores then miss in parallel, not one after another).
  const int64_t slot_bytes = static_cast<int64_t>(num_kv_heads) * head_dim;
  for (int32_t n = 0; n < append.num_tokens; ++n) {
    const int64_t offset =
        static_cast<int64_t>(append.layer[n]) * geo.LayerElements() + append.slot[n] * slot_bytes;
    for (int64_t byte = 0; byte < slot_bytes; byte += 64) {
      __builtin_prefetch(cache.k + offset + byte, 1, 3);
      __builtin_prefetch(cache.v + offset + byte, 1, 3);
    }
  }
  for (int32_t n = 0; n < append.num_tokens; ++n) {
    const int32_t layer = append.layer[n];
    const int64_t element_base = static_cast<int64_t>(layer) * geo.LayerElements();
    const int64_t scale_base = static_cast<int64_t>(layer) * geo.LayerScales();
    const float layer_k_scale = per_token_head ? 1.0f : cache.layer_k_scale[layer];
    const float layer_v_scale = per_token_head ? 1.0f : cache.layer_v_scale[layer];
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t row = append.slot[n] * num_kv_heads + h;  // row of [.., Hkv] storage
      const int64_t input_offset = (static_cast<int64_t>(n) * num_kv_heads + h) * head_dim;
      const int64_t cache_offset = element_base + row * head_dim;
      quantise(append.k_new + input_offset, head_dim, layer_k_scale, cache.k + cache_offset,
               per_token_head ? cache.k_token_scale + scale_base + row : nullptr);
      quantise(append.v_new + input_offset, head_dim, layer_v_scale, cache.v + cache_offset,
               per_token_head ? cache.v_token_scale + scale_base + row : nullptr);
    }
  }
}

}  // namespace sds
