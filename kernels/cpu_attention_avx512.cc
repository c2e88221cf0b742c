// AVX-512 parts of the x86 kernel (kAvx512Bf16 path): the score pass with BF16 dot
// products and the value pass with zmm accumulators, used by DecodeItemAvx2 when the
// CPU has AVX-512F/BW/BF16 (same FP8 -> fp16 bit trick as the AVX2 file); and the fused
// item (VBMI: keys looked up as exact bf16 with vpermi2b; one or more KV heads whose
// token slots are read together), used by cpu_attention.cc where the shape allows.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cpu_attention_item.h"
#include "kernels/fp8.h"

#if defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512bf16,avx512vbmi")
// GCC 12's AVX-512 cast/extract intrinsics trip -Wmaybe-uninitialized on their own
// undefined pass-through operand (GCC PR 105593); the warning is about the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace sds::cpu_internal {
namespace {

// Locality hint of the prefetches that fetch the next item's rows a whole item ahead:
// 2 (prefetcht1). Small shape, batch 64 after 500 us idle, both cores: 215-224 us per
// batch against 243-277 with 3 (prefetcht0, with which the prefetch instructions
// themselves stalled in the server profile) and 243-268 with 0 (prefetchnta).
constexpr int kNextItemLocality = 2;

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
  for (int n = 0; n < item.prefetch_rows; ++n) PrefetchRows(item, n, stride);
  for (int n0 = 0; n0 < stride; n0 += kRows) {
    float factor[kRows];
    for (int t = 0; t < kRows; ++t) {
      PrefetchRows(item, n0 + t + item.prefetch_rows, stride);
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

// The bf16 bits of every FP8 E4M3 magnitude code 0..127 (exact: 3 mantissa bits, and
// even the subnormal codes are normal bf16), split into high and low bytes so that
// vpermi2b can look 64 codes up at once.
struct Bf16ByteTables {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};

const Bf16ByteTables& ByteTables() {
  static const Bf16ByteTables tables = [] {
    Bf16ByteTables t{};
    for (int code = 0; code < 128; ++code) {
      const uint32_t bits = FloatToBits(Fp8E4m3ToFloat(static_cast<uint8_t>(code))) >> 16;
      t.high[code] = static_cast<uint8_t>(bits >> 8);
      t.low[code] = static_cast<uint8_t>(bits);
    }
    return t;
  }();
  return tables;
}

// 64 FP8 codes -> their exact bf16 values in two vectors, in the interleaved order of
// vpunpck{l,h}bw: first holds codes 16L + 0..7 and second codes 16L + 8..15 of each
// 128-bit lane L. The query is permuted to match (PermuteQuery).
struct TableKeys {
  __m512i high_a, high_b, low_a, low_b;
  void Dequantise(const uint8_t* codes_ptr, __m512bh* first, __m512bh* second) const {
    Dequantise(_mm512_loadu_si512(codes_ptr), first, second);
  }
  void Dequantise(__m512i codes, __m512bh* first, __m512bh* second) const {
    // high byte from the table (bits 0..6 of the code), sign from bit 7: a | (b & c).
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high_a, codes, high_b),
                                                   codes, _mm512_set1_epi8(-128), 0xF8);
    const __m512i low = _mm512_permutex2var_epi8(low_a, codes, low_b);
    *first = (__m512bh)_mm512_unpacklo_epi8(low, high);
    *second = (__m512bh)_mm512_unpackhi_epi8(low, high);
  }
};

// query: [G, D] bf16 -> permuted: [G, D] bf16 in the order TableKeys produces, per 64:
// permuted[base + k] = query[base + (k / 8) * 16 + k % 8] and permuted[base + 32 + k] =
// the element 8 further on (k < 32), two vpermt2w per 64 elements.
void PermuteQuery(const uint16_t* query, int elements, uint16_t* permuted) {
  alignas(64) uint16_t first[32], second[32];
  for (int k = 0; k < 32; ++k) {
    first[k] = static_cast<uint16_t>((k / 8) * 16 + k % 8);
    second[k] = static_cast<uint16_t>(first[k] + 8);
  }
  const __m512i first_index = _mm512_load_si512(first);
  const __m512i second_index = _mm512_load_si512(second);
  for (int base = 0; base < elements; base += 64) {
    const __m512i low = _mm512_loadu_si512(query + base);
    const __m512i high = _mm512_loadu_si512(query + base + 32);
    _mm512_storeu_si512(permuted + base, _mm512_permutex2var_epi16(low, first_index, high));
    _mm512_storeu_si512(permuted + base + 32, _mm512_permutex2var_epi16(low, second_index, high));
  }
}

TableKeys LoadTableKeys() {
  const Bf16ByteTables& tables = ByteTables();
  TableKeys lookup;
  lookup.high_a = _mm512_load_si512(tables.high);
  lookup.high_b = _mm512_load_si512(tables.high + 64);
  lookup.low_a = _mm512_load_si512(tables.low);
  lookup.low_b = _mm512_load_si512(tables.low + 64);
  return lookup;
}

// Rows per score tile for G == kHeads: kRows * kHeads <= 16 accumulators.
template <int kHeads>
inline constexpr int kTableRows = kHeads == 4 ? 4 : 8;  // divides 8, the padding of stride

// One score tile: kRows rows x kHeads query heads of one KV head, keys looked up as bf16
// (vpermi2b) and kept in registers. codes: kRows pointers to [D] FP8 K codes;
// query: [kHeads, D] bf16 permuted (PermuteQuery); factor: [kRows] k_scale / sqrt(D);
// scores: [kHeads, stride] out, written at columns 0..kRows-1. D % 64 == 0.
template <int kHeads>
inline void ScoreTile(const TableKeys& lookup, const uint8_t* const* codes, const uint16_t* query,
                      int head_dim, const float* factor, float* scores, int stride) {
  constexpr int kRows = kTableRows<kHeads>, kAccumulators = kRows * kHeads;
  static_assert(kAccumulators % 8 == 0);
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_setzero_ps();
  for (int c = 0; c < head_dim / 64; ++c) {
    __m512bh key[kRows][2];
    for (int t = 0; t < kRows; ++t) lookup.Dequantise(codes[t] + 64 * c, &key[t][0], &key[t][1]);
    for (int h = 0; h < kHeads; ++h)
      for (int half = 0; half < 2; ++half) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(query + h * head_dim + 64 * c + 32 * half);
        for (int t = 0; t < kRows; ++t)
          acc[t * kHeads + h] = _mm512_dpbf16_ps(acc[t * kHeads + h], q, key[t][half]);
      }
  }
  for (int base = 0; base < kAccumulators; base += 8) {
    __m256 folded[8];
    for (int i = 0; i < 8; ++i) folded[i] = FoldToEight(acc[base + i]);
    alignas(32) float dots[8];
    _mm256_store_ps(dots, ReduceEight(folded));
    for (int i = 0; i < 8; ++i) {
      const int t = (base + i) / kHeads, h = (base + i) % kHeads;
      scores[h * stride + t] = dots[i] * factor[t];
    }
  }
}

// In-register 16 x 16 transpose of dwords. v: [16] vectors of [16] dwords, in place: on
// return v[j] lane i holds what was v[i] lane j (four shuffle stages of 16 instructions).
inline void TransposeSixteenDwords(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int g = 0; g < 16; g += 8)
    for (int m = 0; m < 4; ++m) {
      t[g + m] = _mm512_shuffle_i32x4(v[g + m], v[g + 4 + m], 0x88);
      t[g + 4 + m] = _mm512_shuffle_i32x4(v[g + m], v[g + 4 + m], 0xDD);
    }
  for (int m = 0; m < 8; ++m) {
    v[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);
    v[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xDD);
  }
}

// Rows per tile of ScoreTileRowsInLanes.
constexpr int kLaneRows = 16;

// One score tile of 16 rows x 4 query heads of one KV head with the rows in the lanes,
// so that no sum needs a horizontal reduction (~40 % of ScoreTile's samples at D 64;
// -7 to -14 % per small-shape request, bench/RESULTS.md): per 64 dimensions the 16
// rows' K codes are transposed (vector j: dims 4j..4j+3 of every row), looked up as
// bf16 (TableKeys: `first` holds rows 4L, 4L+1 of each 128-bit lane L as (dims 4j,
// 4j+1), (4j+2, 4j+3) pairs, `second` rows 4L+2, 4L+3) and multiplied with q's dims
// 4j..4j+3 broadcast; a final shuffle adds each row's two pair sums. codes: [16] pointers to [D]
// FP8 K codes; query: [4, D] bf16 (not permuted); factor: [16] k_scale / sqrt(D); scores: [4,
// stride] out, columns 0..15. D % 64 == 0.
inline void ScoreTileRowsInLanes(const TableKeys& lookup, const uint8_t* const* codes,
                                 const uint16_t* query, int head_dim, const float* factor,
                                 float* scores, int stride) {
  constexpr int kHeads = 4;
  __m512 first_acc[kHeads], second_acc[kHeads];
  for (int h = 0; h < kHeads; ++h) first_acc[h] = second_acc[h] = _mm512_setzero_ps();
  for (int c = 0; c < head_dim / 64; ++c) {
    __m512i column[16];
    for (int i = 0; i < 16; ++i) column[i] = _mm512_loadu_si512(codes[i] + 64 * c);
    TransposeSixteenDwords(column);
    for (int j = 0; j < 16; ++j) {
      __m512bh first, second;
      lookup.Dequantise(column[j], &first, &second);
      for (int h = 0; h < kHeads; ++h) {
        int64_t pairs;  // q[h][64c + 4j .. 64c + 4j + 3], bf16
        std::memcpy(&pairs, query + h * head_dim + 64 * c + 4 * j, sizeof pairs);
        const __m512bh q = (__m512bh)_mm512_set1_epi64(pairs);
        first_acc[h] = _mm512_dpbf16_ps(first_acc[h], first, q);
        second_acc[h] = _mm512_dpbf16_ps(second_acc[h], second, q);
      }
    }
  }
  const __m512 factors = _mm512_loadu_ps(factor);
  for (int h = 0; h < kHeads; ++h) {
    const __m512 dots = _mm512_add_ps(_mm512_shuffle_ps(first_acc[h], second_acc[h], 0x88),
                                      _mm512_shuffle_ps(first_acc[h], second_acc[h], 0xDD));
    _mm512_storeu_ps(scores + h * stride, _mm512_mul_ps(dots, factors));
  }
}

// The fused item's score pass: each tile of token slots is read once for all kv_heads
// KV heads (K codes of a slot: kv_heads * D contiguous bytes). scores: [H * G, stride].
template <int kHeads>
void FusedScorePass(const DecodeItem& item, int stride) {
  constexpr int kRows = kTableRows<kHeads>;
  const int head_dim = item.head_dim, kv_heads = item.kv_heads;
  const int span = kv_heads * head_dim, ahead = item.prefetch_rows;
  uint16_t* query = reinterpret_cast<uint16_t*>(item.q_f32);  // [H * G, D] bf16, permuted
  // ScoreTile's query order (the 16-row tiles of G == 4 read item.q as it is).
  if (kHeads != 4 || stride % kLaneRows != 0)
    PermuteQuery(item.q, kv_heads * kHeads * head_dim, query);
  const TableKeys lookup = LoadTableKeys();
  const bool own = !item.rows_prefetched;  // else the previous item prefetched K and V
  if (own)
    for (int n = 0; n < ahead && n < stride; ++n)
      for (int byte = 0; byte < span; byte += 64)
        __builtin_prefetch(item.k_layer + item.rows[n] * head_dim + byte, 0, 3);
  const int next_rows = item.next_rows == nullptr ? 0 : item.next_num_rows;
  for (int n0 = 0; n0 < stride;) {
    // G == 4 runs 16-row tiles with the rows in the lanes while 16 rows remain (stride
    // is a multiple of 8: at most one ScoreTile pair of 4-row tiles ends the pass).
    const bool lanes = kHeads == 4 && n0 + kLaneRows <= stride;
    const int rows = lanes ? kLaneRows : kRows;
    const uint8_t* codes[kLaneRows];
    const uint8_t* future[kLaneRows];  // the slots `ahead` rows on (or nullptr past the end)
    for (int t = 0; t < rows; ++t) {
      codes[t] = item.k_layer + item.rows[n0 + t] * head_dim;
      const int n = n0 + t + ahead;
      future[t] = own && n < stride ? item.k_layer + item.rows[n] * head_dim : nullptr;
    }
    // The next item's K rows that fall to this tile (the same share of its rows).
    const int next_begin = n0 * next_rows / stride, next_end = (n0 + rows) * next_rows / stride;
    for (int b = 0; b < kv_heads; ++b) {
      // Prefetches spread over the heads (a few lines at a time, so none are dropped):
      // head b's D bytes of each future slot.
      for (int t = 0; t < rows; ++t)
        if (future[t] != nullptr)
          for (int byte = 0; byte < head_dim; byte += 64)
            __builtin_prefetch(future[t] + b * head_dim + byte, 0, 3);
      if (own && item.prefetch_values_early)  // this tile's V rows, for the value pass
        for (int t = 0; t < rows; ++t)
          for (int byte = 0; byte < head_dim; byte += 64)
            __builtin_prefetch(item.v_layer + item.rows[n0 + t] * head_dim + b * head_dim + byte, 0,
                               3);
      for (int n = next_begin; n < next_end; ++n)
        for (int byte = 0; byte < head_dim; byte += 64)
          __builtin_prefetch(item.next_k_layer + item.next_rows[n] * head_dim + b * head_dim + byte,
                             0, kNextItemLocality);
      float factor[kLaneRows];
      for (int t = 0; t < rows; ++t)
        factor[t] = item.k_scale[b * stride + n0 + t] * item.inv_sqrt_d;
      float* scores = item.scores + b * kHeads * stride + n0;
      bool tiled = false;
      if constexpr (kHeads == 4) {
        if (lanes) {
          ScoreTileRowsInLanes(lookup, codes, item.q + b * kHeads * head_dim, head_dim, factor,
                               scores, stride);
          tiled = true;
        }
      }
      if (!tiled)
        ScoreTile<kHeads>(lookup, codes, query + b * kHeads * head_dim, head_dim, factor, scores,
                          stride);
      for (int t = 0; t < rows; ++t) codes[t] += head_dim;
    }
    n0 += rows;
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
  FillValueWeights(item, kHeads, stride);
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

// The fused item's value pass, G == kHeads: tiles of 8 token slots are read once for
// all kv_heads KV heads; per KV head and chunk of 16 * kVecs dimensions the
// accumulators go through registers, rows added in index order with the same
// operations as ValuePassZmm (so the sums are the same bits). acc: [H * G, D].
template <int kHeads, int kVecs>
void FusedValuePass(const DecodeItem& item, int stride) {
  static_assert(kHeads * kVecs <= 16);
  constexpr int kTile = 8;
  const int head_dim = item.head_dim, num_rows = item.num_rows, kv_heads = item.kv_heads;
  const int span = kv_heads * head_dim, ahead = item.prefetch_rows;
  // weights: [H, kHeads, stride], the scores' layout: p * v_scale * kFp16CodeScale (the
  // same two products as FillValueWeights, so the same bits), 16 rows at a time.
  const __m512 code_scale = _mm512_set1_ps(kFp16CodeScale);
  for (int b = 0; b < kv_heads; ++b)
    for (int h = 0; h < kHeads; ++h) {
      const float* p = item.scores + (b * kHeads + h) * stride;
      const float* v_scale = item.v_scale + b * stride;
      float* w = item.weights + (b * kHeads + h) * stride;
      int n = 0;
      for (; n + 16 <= num_rows; n += 16)
        _mm512_storeu_ps(w + n, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(p + n),
                                                            _mm512_loadu_ps(v_scale + n)),
                                              code_scale));
      for (; n < num_rows; ++n) w[n] = p[n] * v_scale[n] * kFp16CodeScale;
    }
  for (int e = 0; e < kv_heads * kHeads * head_dim; e += 16)
    _mm512_storeu_ps(item.acc + e, _mm512_setzero_ps());
  // V rows already prefetched: by the score pass, or by the previous item.
  const bool early = item.prefetch_values_early || item.rows_prefetched;
  if (!early)
    for (int n = 0; n < ahead && n < num_rows; ++n)
      for (int byte = 0; byte < span; byte += 64)
        __builtin_prefetch(item.v_layer + item.rows[n] * head_dim + byte, 0, 3);
  const int next_rows = item.next_rows == nullptr ? 0 : item.next_num_rows;
  for (int n0 = 0; n0 < num_rows; n0 += kTile) {
    const int count = num_rows - n0 < kTile ? num_rows - n0 : kTile;
    const uint8_t* future[kTile];  // the slots `ahead` rows on (or nullptr past the end)
    for (int t = 0; t < kTile; ++t) {
      const int n = n0 + t + ahead;
      future[t] = !early && n < num_rows ? item.v_layer + item.rows[n] * head_dim : nullptr;
    }
    // The next item's V rows that fall to this tile (the same share of its rows).
    for (int n = n0 * next_rows / num_rows, end = (n0 + count) * next_rows / num_rows; n < end; ++n)
      for (int byte = 0; byte < span; byte += 64)
        __builtin_prefetch(item.next_v_layer + item.next_rows[n] * head_dim + byte, 0,
                           kNextItemLocality);
    for (int b = 0; b < kv_heads; ++b) {
      const float* weights = item.weights + b * kHeads * stride + n0;  // [kHeads, stride]
      for (int j0 = 0; j0 < head_dim; j0 += 16 * kVecs) {
        // Prefetches spread over the chunks: the same bytes of each future slot.
        for (int t = 0; t < kTile; ++t)
          if (future[t] != nullptr)
            for (int byte = 0; byte < 16 * kVecs; byte += 64)
              __builtin_prefetch(future[t] + b * head_dim + j0 + byte, 0, 3);
        float* acc_base = item.acc + b * kHeads * head_dim + j0;
        __m512 acc[kHeads][kVecs];
        for (int h = 0; h < kHeads; ++h)
          for (int v = 0; v < kVecs; ++v)
            acc[h][v] = _mm512_loadu_ps(acc_base + h * head_dim + 16 * v);
        const uint8_t* chunk = item.v_layer + b * head_dim + j0;
        for (int t = 0; t < count; ++t) {
          const uint8_t* codes = chunk + item.rows[n0 + t] * head_dim;
          __m512 value[kVecs];
          for (int v = 0; v < kVecs; ++v) value[v] = DequantiseSixteenZmm(codes + 16 * v);
          for (int h = 0; h < kHeads; ++h) {
            const __m512 weight = _mm512_set1_ps(weights[h * stride + t]);
            for (int v = 0; v < kVecs; ++v)
              acc[h][v] = _mm512_fmadd_ps(weight, value[v], acc[h][v]);
          }
        }
        for (int h = 0; h < kHeads; ++h)
          for (int v = 0; v < kVecs; ++v)
            _mm512_storeu_ps(acc_base + h * head_dim + 16 * v, acc[h][v]);
      }
    }
  }
}

// exp(x) for x <= 0, sixteen lanes: the operations of the AVX2 file's ExpNonPositive8
// lane for lane (same rounding, same fused multiply-adds), so the same bits.
inline __m512 ExpNonPositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpClamp));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), r);
  __m512 poly = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 exp_r =
      _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(poly, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i power =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(exp_r, _mm512_castsi512_ps(power));
}

// GatePassAvx512 over `elements` (a multiple of 16): gate, out: [elements] bf16; acc:
// [elements] floats.
void GatePassZmm(const uint16_t* gate_in, const float* acc, int elements, uint16_t* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int e = 0; e < elements; e += 16) {
    const __m512i gate_bits = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate_in + e))),
        16);
    const __m512 gate = _mm512_castsi512_ps(gate_bits);
    const __m512 exp_neg_abs =
        ExpNonPositive16(_mm512_castsi512_ps(_mm512_or_si512(gate_bits, sign_bit)));  // exp(-|g|)
    const __m512 numerator = _mm512_mask_blend_ps(
        _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ), one, exp_neg_abs);
    const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(one, exp_neg_abs));
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(acc + e), sigmoid));
    const __m512i rounding =
        _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                         _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
    // (bits + rounding) >> 16 is at most 0xFFFF: truncating to 16 bits keeps it whole.
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, rounding), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), _mm512_cvtepi32_epi16(rounded));
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

// The AVX2 file's SoftmaxPass sixteen lanes at a time, with the same bits: the same max
// (exact in any order), ExpNonPositive16 (ExpNonPositive8 lane for lane), the exps summed
// into eight lanes in the AVX2 order (lanes 0-7 of each zmm, then lanes 8-15), the eight
// lanes reduced as ReduceEight does. scores: [G, stride] (stride a multiple of 8) become
// probabilities, the padded tail [num_rows, stride) 0; lse: [G] when item.lse is set.
// (The AVX2 pass took 10 % of a small request's time in bench_cpu_attention's hot case.)
void SoftmaxPassAvx512(const DecodeItem& item, int stride) {
  const int num_rows = item.num_rows;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int g = 0; g < item.group; ++g) {
    float* p = item.scores + g * stride;
    __m512 max16 = minus_inf;
    for (int n = 0; n < stride; n += 16) {
      const __mmask16 in_row = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(num_rows - n));
      max16 = _mm512_max_ps(max16, _mm512_mask_loadu_ps(minus_inf, in_row, p + n));
    }
    const float max_score = _mm512_reduce_max_ps(max16);
    const __m512 max_b = _mm512_set1_ps(max_score);
    __m256 sum8 = _mm256_setzero_ps();
    for (int n = 0; n < stride; n += 16) {
      const bool whole = n + 16 <= stride;  // else 8 lanes (stride % 8 == 0)
      const __mmask16 in_stride = whole ? 0xFFFF : 0x00FF;
      const __mmask16 in_row = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(num_rows - n));
      const __m512 x = _mm512_mask_loadu_ps(minus_inf, in_row, p + n);
      const __m512 e = _mm512_maskz_mov_ps(in_row, ExpNonPositive16(_mm512_sub_ps(x, max_b)));
      _mm512_mask_storeu_ps(p + n, in_stride, e);
      sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
      if (whole)  // lanes 8-15 (extractf32x8 would need AVX-512 DQ)
        sum8 =
            _mm256_add_ps(sum8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    // ReduceEight's order: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
    const __m128 low = _mm256_castps256_ps128(sum8), high = _mm256_extractf128_ps(sum8, 1);
    const __m128 low_pairs = _mm_hadd_ps(low, low), high_pairs = _mm_hadd_ps(high, high);
    const float sum = _mm_cvtss_f32(_mm_hadd_ps(low_pairs, low_pairs)) +
                      _mm_cvtss_f32(_mm_hadd_ps(high_pairs, high_pairs));
    if (item.lse) item.lse[g] = max_score + std::log(sum);
    const __m512 inv_sum = _mm512_set1_ps(1.0f / sum);
    for (int n = 0; n < stride; n += 16) {
      const __mmask16 in_stride = n + 16 <= stride ? 0xFFFF : 0x00FF;
      _mm512_mask_storeu_ps(p + n, in_stride,
                            _mm512_mul_ps(_mm512_maskz_loadu_ps(in_stride, p + n), inv_sum));
    }
  }
}

void GatePassAvx512(const DecodeItem& item) {
  GatePassZmm(item.gate, item.acc, item.group * item.head_dim, item.out);
}

bool FusedItemSupported(int group, int head_dim) {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi && head_dim % 64 == 0 && (group == 4 || group == 2 || group == 1) &&
         (group == 4 || head_dim % 128 == 0);
}

void DecodeItemFusedAvx512(const DecodeItem& item) {
  const int stride = (item.num_rows + 7) / 8 * 8;
  switch (item.group) {
    case 4:
      FusedScorePass<4>(item, stride);
      break;
    case 2:
      FusedScorePass<2>(item, stride);
      break;
    default:
      FusedScorePass<1>(item, stride);
      break;
  }
  for (int b = 0; b < item.kv_heads; ++b) {
    DecodeItem head = item;
    head.kv_heads = 1;
    head.scores = item.scores + b * item.group * stride;
    head.lse = item.lse ? item.lse + b * item.group : nullptr;
    SoftmaxPassAvx512(head, stride);
  }
  switch (item.group) {
    case 4:
      FusedValuePass<4, 4>(item, stride);
      break;
    case 2:
      FusedValuePass<2, 8>(item, stride);
      break;
    default:
      FusedValuePass<1, 8>(item, stride);
      break;
  }
  // The gate is element-wise over [H * G, D].
  GatePassZmm(item.gate, item.acc, item.kv_heads * item.group * item.head_dim, item.out);
}

}  // namespace sds::cpu_internal

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
