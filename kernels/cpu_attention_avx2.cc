// AVX2/FMA/F16C kernel of one (request, KV head) work item, selected at run time.
// FP8 dequantisation: an E4M3 byte placed in the sign, exponent and top mantissa bits
// of an fp16 ((byte sign-extended << 7) & 0xBF80) is exactly value * 2^-8, which F16C
// converts to float; the 2^8 is folded into the scales. Requires D % 16 == 0.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu_attention_item.h"
#include "kernels/fp8.h"

#if defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace sds::cpu_internal {
namespace {

// codes: [D] FP8 bytes -> values: [D] floats equal to value / 256.
inline void DequantiseRow(const uint8_t* codes, int head_dim, float* values) {
  const __m256i fp16_mask = _mm256_set1_epi16(static_cast<int16_t>(0xBF80));
  for (int j = 0; j < head_dim; j += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
    const __m256i halves =
        _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), fp16_mask);
    _mm256_storeu_ps(values + j, _mm256_cvtph_ps(_mm256_castsi256_si128(halves)));
    _mm256_storeu_ps(values + j + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)));
  }
}

// Lane i of the result is the sum of the eight lanes of acc[i] (fixed order).
inline __m256 ReduceEight(const __m256* acc) {
  const __m256 pair01 = _mm256_hadd_ps(acc[0], acc[1]);
  const __m256 pair23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 pair45 = _mm256_hadd_ps(acc[4], acc[5]);
  const __m256 pair67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 quad0123 = _mm256_hadd_ps(pair01, pair23);
  const __m256 quad4567 = _mm256_hadd_ps(pair45, pair67);
  return _mm256_add_ps(_mm256_permute2f128_ps(quad0123, quad4567, 0x20),
                       _mm256_permute2f128_ps(quad0123, quad4567, 0x31));
}

// exp(x) for x <= 0, eight lanes; same polynomial as ExpNonPositive.
inline __m256 ExpNonPositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpClamp));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), r);
  __m256 poly = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 exp_r =
      _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(poly, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i power =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp_r, _mm256_castsi256_ps(power));
}

// Scores of all rows for all heads, in tiles of (8 / kHeads) rows x kHeads heads so
// that eight dot products reduce together. scores: [G, stride].
template <int kHeads>
void ScorePass(const DecodeItem& item, int stride) {
  constexpr int kRows = 8 / kHeads;
  const int head_dim = item.head_dim;
  for (int n = 0; n < item.prefetch_rows; ++n) PrefetchRows(item, n, stride);
  for (int n0 = 0; n0 < stride; n0 += kRows) {
    for (int t = 0; t < kRows; ++t) {
      PrefetchRows(item, n0 + t + item.prefetch_rows, stride);
      DequantiseRow(item.k_layer + item.rows[n0 + t] * head_dim, head_dim,
                    item.row_buffer + t * head_dim);
    }
    float factor[kRows];
    for (int t = 0; t < kRows; ++t)
      factor[t] = item.k_scale[n0 + t] * item.inv_sqrt_d * kFp16CodeScale;
    for (int g0 = 0; g0 < item.group; g0 += kHeads) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      const float* q = item.q_f32 + g0 * head_dim;
      for (int j = 0; j < head_dim; j += 8) {
        __m256 key[kRows];
        for (int t = 0; t < kRows; ++t)
          key[t] = _mm256_loadu_ps(item.row_buffer + t * head_dim + j);
        for (int h = 0; h < kHeads; ++h) {
          const __m256 query = _mm256_loadu_ps(q + h * head_dim + j);
          for (int t = 0; t < kRows; ++t)
            acc[t * kHeads + h] = _mm256_fmadd_ps(query, key[t], acc[t * kHeads + h]);
        }
      }
      alignas(32) float dots[8];
      _mm256_store_ps(dots, ReduceEight(acc));
      for (int t = 0; t < kRows; ++t)
        for (int h = 0; h < kHeads; ++h)
          item.scores[(g0 + h) * stride + n0 + t] = dots[t * kHeads + h] * factor[t];
    }
  }
}

// Turns scores into normalised probabilities per head (padded tail becomes 0).
void SoftmaxPass(const DecodeItem& item, int stride) {
  const int num_rows = item.num_rows;
  for (int g = 0; g < item.group; ++g) {
    float* p = item.scores + g * stride;
    for (int n = num_rows; n < stride; ++n) p[n] = -std::numeric_limits<float>::infinity();
    __m256 max8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int n = 0; n < stride; n += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(p + n));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, max8);
    float max_score = lanes[0];
    for (int lane = 1; lane < 8; ++lane) max_score = std::fmax(max_score, lanes[lane]);
    const __m256 max_b = _mm256_set1_ps(max_score);
    __m256 sum8 = _mm256_setzero_ps();
    for (int n = 0; n < stride; n += 8) {
      __m256 e = ExpNonPositive8(_mm256_sub_ps(_mm256_loadu_ps(p + n), max_b));
      if (n + 8 > num_rows) {  // zero the padded tail
        const __m256 index = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(n)),
                                           _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
        e = _mm256_and_ps(
            e, _mm256_cmp_ps(index, _mm256_set1_ps(static_cast<float>(num_rows)), _CMP_LT_OQ));
      }
      _mm256_storeu_ps(p + n, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    __m256 same[8] = {sum8, sum8, sum8, sum8, sum8, sum8, sum8, sum8};
    const float sum = _mm256_cvtss_f32(ReduceEight(same));
    if (item.lse) item.lse[g] = max_score + std::log(sum);
    const __m256 inv_sum = _mm256_set1_ps(1.0f / sum);
    for (int n = 0; n < stride; n += 8)
      _mm256_storeu_ps(p + n, _mm256_mul_ps(_mm256_loadu_ps(p + n), inv_sum));
  }
}

// acc[g] = sum over rows of p[g][n] * v_scale[n] * V[n], in tiles of 4 rows x kHeads heads.
template <int kHeads>
void ValuePass(const DecodeItem& item, int stride) {
  constexpr int kRows = 4;
  const int head_dim = item.head_dim;
  for (int e = 0; e < item.group * head_dim; e += 8)
    _mm256_storeu_ps(item.acc + e, _mm256_setzero_ps());
  for (int n0 = 0; n0 < stride; n0 += kRows) {
    for (int t = 0; t < kRows; ++t)
      DequantiseRow(item.v_layer + item.rows[n0 + t] * head_dim, head_dim,
                    item.row_buffer + t * head_dim);
    for (int g0 = 0; g0 < item.group; g0 += kHeads) {
      __m256 weight[kHeads][kRows];
      for (int h = 0; h < kHeads; ++h)
        for (int t = 0; t < kRows; ++t)
          weight[h][t] = _mm256_set1_ps(item.scores[(g0 + h) * stride + n0 + t] *
                                        item.v_scale[n0 + t] * kFp16CodeScale);
      for (int j = 0; j < head_dim; j += 8) {
        __m256 value[kRows];
        for (int t = 0; t < kRows; ++t)
          value[t] = _mm256_loadu_ps(item.row_buffer + t * head_dim + j);
        for (int h = 0; h < kHeads; ++h) {
          float* acc = item.acc + (g0 + h) * head_dim + j;
          __m256 sum = _mm256_loadu_ps(acc);
          for (int t = 0; t < kRows; ++t) sum = _mm256_fmadd_ps(weight[h][t], value[t], sum);
          _mm256_storeu_ps(acc, sum);
        }
      }
    }
  }
}

// Eight lanes of FP8 codes -> floats equal to value / 256.
inline __m256 DequantiseEight(const uint8_t* codes) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  const __m128i halves = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                       _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm256_cvtph_ps(halves);
}

// ValuePass for G == kHeads <= 8: the accumulators of a chunk of 8 * kVecs dimensions
// of all heads stay in registers while every row streams by (rows are in L1/L2 after
// the score pass prefetched them). Each row byte is dequantised once.
template <int kHeads, int kVecs>
void ValuePassInRegisters(const DecodeItem& item, int stride) {
  static_assert(kHeads * kVecs == 8);
  const int head_dim = item.head_dim, num_rows = item.num_rows;
  FillValueWeights(item, kHeads, stride);
  for (int j0 = 0; j0 < head_dim; j0 += 8 * kVecs) {
    __m256 acc[kHeads][kVecs];
    for (int h = 0; h < kHeads; ++h)
      for (int v = 0; v < kVecs; ++v) acc[h][v] = _mm256_setzero_ps();
    const uint8_t* chunk = item.v_layer + j0;
    for (int n = 0; n < num_rows; ++n) {
      const uint8_t* codes = chunk + item.rows[n] * head_dim;
      __m256 value[kVecs];
      for (int v = 0; v < kVecs; ++v) value[v] = DequantiseEight(codes + 8 * v);
      for (int h = 0; h < kHeads; ++h) {
        const __m256 weight = _mm256_broadcast_ss(item.weights + n * kHeads + h);
        for (int v = 0; v < kVecs; ++v) acc[h][v] = _mm256_fmadd_ps(weight, value[v], acc[h][v]);
      }
    }
    for (int h = 0; h < kHeads; ++h)
      for (int v = 0; v < kVecs; ++v)
        _mm256_storeu_ps(item.acc + h * head_dim + j0 + 8 * v, acc[h][v]);
  }
}

// out = acc * sigmoid(gate), rounded to bf16 (nearest even).
void GatePass(const DecodeItem& item) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int e = 0; e < item.group * item.head_dim; e += 8) {
    const __m128i gate_bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(item.gate + e));
    const __m256 gate =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(gate_bits), 16));
    const __m256 exp_neg_abs = ExpNonPositive8(_mm256_or_ps(gate, sign_bit));  // exp(-|g|)
    const __m256 numerator =
        _mm256_blendv_ps(one, exp_neg_abs, _mm256_cmp_ps(gate, _mm256_setzero_ps(), _CMP_LT_OQ));
    const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, exp_neg_abs));
    const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(item.acc + e), sigmoid));
    const __m256i rounding =
        _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                         _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, rounding), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(item.out + e), _mm256_castsi256_si128(packed));
  }
}

// Scores with fp32 FMAs: q converted to float once, tiles chosen by G.
void ScorePassAvx2(const DecodeItem& item, int stride) {
  for (int e = 0; e < item.group * item.head_dim; ++e) item.q_f32[e] = Bf16ToFloat(item.q[e]);
  if (item.group % 4 == 0) {
    ScorePass<4>(item, stride);
  } else if (item.group % 2 == 0) {
    ScorePass<2>(item, stride);
  } else {
    ScorePass<1>(item, stride);
  }
}

// The value pass for G and D: register-resident accumulators where a tile fits.
void ValuePassAvx2(const DecodeItem& item, int stride) {
  const int group = item.group, head_dim = item.head_dim;
  if (group == 4) {
    ValuePassInRegisters<4, 2>(item, stride);
  } else if (group == 8) {
    ValuePassInRegisters<8, 1>(item, stride);
  } else if (group == 2 && head_dim % 32 == 0) {
    ValuePassInRegisters<2, 4>(item, stride);
  } else if (group == 1 && head_dim % 64 == 0) {
    ValuePassInRegisters<1, 8>(item, stride);
  } else if (group % 2 == 0) {
    ValuePass<2>(item, stride);
  } else {
    ValuePass<1>(item, stride);
  }
}

}  // namespace

void SoftmaxPassX86(const DecodeItem& item, int stride) { SoftmaxPass(item, stride); }
void GatePassX86(const DecodeItem& item) { GatePass(item); }

void DecodeItemAvx2(const DecodeItem& item) {
  const int stride = (item.num_rows + 7) / 8 * 8;  // rows padded to a multiple of 8
  if (item.bf16_scores) {
    ScorePassAvx512Bf16(item, stride);
  } else {
    ScorePassAvx2(item, stride);
  }
  if (item.bf16_scores) {  // the AVX-512 path: its softmax, the same bits, 16 lanes
    SoftmaxPassAvx512(item, stride);
  } else {
    SoftmaxPass(item, stride);
  }
  if (!item.bf16_scores || !TryValuePassAvx512(item, stride)) ValuePassAvx2(item, stride);
  if (item.bf16_scores) {  // likewise its gate pass (G * D % 16 == 0: D % 16 == 0 here)
    GatePassAvx512(item);
  } else {
    GatePass(item);
  }
}

}  // namespace sds::cpu_internal

#if defined(__GNUC__)
#pragma GCC pop_options
#endif
