// AVX-512 parts of the x86 kernel (kAvx512Bf16 path): the score pass with BF16 dot
// products and the value pass with zmm accumulators. Used by DecodeItemAvx2 when the
// CPU has AVX-512F/BW/BF16; same FP8 -> fp16 bit trick as the AVX2 file.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu_attention_item.h"

#if defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512bf16")
// GCC 12's AVX-512 cast/extract intrinsics trip -Wmaybe-uninitialized on their own
// undefined pass-through operand (GCC PR 105593); the warning is about the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace sds::cpu_internal {
namespace {

// Lane i of the result is the sum of the eight lanes of acc[i] (fixed order). A copy
// of the AVX2 file's helper: target-specific inline functions are not shared through
// headers, so no baseline translation unit can pick up an AVX-512 copy.
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

// ScorePass with AVX-512 BF16 dot products (twice the multiply-adds per instruction).
// FP8 -> fp16 -> float -> bf16 is exact (value / 256, a normal bf16 even for FP8
// subnormals, so the instruction's denormal flushing never drops a key); q is bf16
// already; the products are exact and accumulate in float32. Needs D % 32 == 0.
// codes: [32] FP8 bytes -> 32 bf16 equal to value / 256.
inline __m512bh DequantiseThirtyTwoBf16(const uint8_t* codes) {
  const __m512i halves = _mm512_and_si512(
      _mm512_slli_epi16(
          _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))), 7),
      _mm512_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m512 low = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
  const __m512 high = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
  return _mm512_cvtne2ps_pbh(high, low);  // elements 0..15 from low, 16..31 from high
}

inline __m256 FoldToEight(__m512 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

template <int kHeads, int kAccumulators>
void ScorePassBf16(const DecodeItem& item, int stride) {
  static_assert(kAccumulators % 8 == 0 && kAccumulators % kHeads == 0);
  constexpr int kRows = kAccumulators / kHeads;  // divides 8, the padding of stride
  static_assert(8 % kRows == 0);
  const int head_dim = item.head_dim;
  // The tile's K rows as bf16, dequantised once and shared by every head block.
  uint16_t* keys = reinterpret_cast<uint16_t*>(item.row_buffer);  // [kRows, D] bf16
  const int chunks = head_dim / 32;
  for (int n = 0; n < kPrefetchRows; ++n) PrefetchRows(item, n, stride);
  for (int n0 = 0; n0 < stride; n0 += kRows) {
    float factor[kRows];
    for (int t = 0; t < kRows; ++t) {
      PrefetchRows(item, n0 + t + kPrefetchRows, stride);
      const uint8_t* codes = item.k_layer + item.rows[n0 + t] * head_dim;
      for (int c = 0; c < chunks; ++c)
        _mm512_storeu_si512(keys + t * head_dim + 32 * c,
                            (__m512i)DequantiseThirtyTwoBf16(codes + 32 * c));
      factor[t] = item.k_scale[n0 + t] * item.inv_sqrt_d * kFp16CodeScale;
    }
    for (int g0 = 0; g0 < item.group; g0 += kHeads) {
      __m512 acc[kAccumulators];
      for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_setzero_ps();
      const uint16_t* q = item.q + g0 * head_dim;
      for (int c = 0; c < chunks; ++c) {
        __m512bh key[kRows];
        for (int t = 0; t < kRows; ++t)
          key[t] = (__m512bh)_mm512_loadu_si512(keys + t * head_dim + 32 * c);
        for (int h = 0; h < kHeads; ++h) {
          const __m512bh query = (__m512bh)_mm512_loadu_si512(q + h * head_dim + 32 * c);
          for (int t = 0; t < kRows; ++t)
            acc[t * kHeads + h] = _mm512_dpbf16_ps(acc[t * kHeads + h], query, key[t]);
        }
      }
      for (int base = 0; base < kAccumulators; base += 8) {
        __m256 folded[8];
        for (int i = 0; i < 8; ++i) folded[i] = FoldToEight(acc[base + i]);
        alignas(32) float dots[8];
        _mm256_store_ps(dots, ReduceEight(folded));
        for (int i = 0; i < 8; ++i) {
          const int t = (base + i) / kHeads, h = (base + i) % kHeads;
          item.scores[(g0 + h) * stride + n0 + t] = dots[i] * factor[t];
        }
      }
    }
  }
}

// 16 FP8 codes -> 16 floats equal to value / 256 (same bit trick, one zmm).
inline __m512 DequantiseSixteenZmm(const uint8_t* codes) {
  const __m256i halves = _mm256_and_si256(
      _mm256_slli_epi16(
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))), 7),
      _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm512_cvtph_ps(halves);
}

// ValuePassInRegisters with zmm accumulators: kHeads * kVecs of them (<= 16) hold a
// chunk of 16 * kVecs dimensions of all G == kHeads heads while the rows stream by.
template <int kHeads, int kVecs>
void ValuePassZmm(const DecodeItem& item, int stride) {
  static_assert(kHeads * kVecs <= 16);
  const int head_dim = item.head_dim, num_rows = item.num_rows;
  for (int n = 0; n < num_rows; ++n)
    for (int h = 0; h < kHeads; ++h)
      item.weights[n * kHeads + h] = item.scores[h * stride + n] * item.v_scale[n] * kFp16CodeScale;
  for (int j0 = 0; j0 < head_dim; j0 += 16 * kVecs) {
    __m512 acc[kHeads][kVecs];
    for (int h = 0; h < kHeads; ++h)
      for (int v = 0; v < kVecs; ++v) acc[h][v] = _mm512_setzero_ps();
    const uint8_t* chunk = item.v_layer + j0;
    for (int n = 0; n < num_rows; ++n) {
      const uint8_t* codes = chunk + item.rows[n] * head_dim;
      __m512 value[kVecs];
      for (int v = 0; v < kVecs; ++v) value[v] = DequantiseSixteenZmm(codes + 16 * v);
      for (int h = 0; h < kHeads; ++h) {
        const __m512 weight = _mm512_set1_ps(item.weights[n * kHeads + h]);
        for (int v = 0; v < kVecs; ++v) acc[h][v] = _mm512_fmadd_ps(weight, value[v], acc[h][v]);
      }
    }
    for (int h = 0; h < kHeads; ++h)
      for (int v = 0; v < kVecs; ++v)
        _mm512_storeu_ps(item.acc + h * head_dim + j0 + 16 * v, acc[h][v]);
  }
}

}  // namespace

void ScorePassAvx512Bf16(const DecodeItem& item, int stride) {
  if (item.group % 4 == 0) {
    ScorePassBf16<4, 16>(item, stride);
  } else if (item.group % 2 == 0) {
    ScorePassBf16<2, 16>(item, stride);
  } else {
    ScorePassBf16<1, 8>(item, stride);
  }
}

// The zmm value pass for G in {1, 2, 4, 8}; false when the shape does not fit.
bool TryValuePassAvx512(const DecodeItem& item, int stride) {
  const int head_dim = item.head_dim;
  switch (item.group) {
    case 1:
      if (head_dim % 128 != 0) return false;
      ValuePassZmm<1, 8>(item, stride);
      return true;
    case 2:
      if (head_dim % 128 != 0) return false;
      ValuePassZmm<2, 8>(item, stride);
      return true;
    case 4:
      if (head_dim % 64 != 0) return false;
      ValuePassZmm<4, 4>(item, stride);
      return true;
    case 8:
      ValuePassZmm<8, 2>(item, stride);  // D % 32 == 0 holds on this path
      return true;
    default:
      return false;
  }
}

}  // namespace sds::cpu_internal

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
