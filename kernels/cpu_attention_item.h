// Internal to the CPU attention: one (request, KV head) work item, or a fused one over
// several KV heads, and the kernels that compute them. Not part of the public interface.
#pragma once

#include <cstdint>

#include "kernels/fp8.h"

namespace sds::cpu_internal {

// Everything one work item needs; all pointers are host pointers.
struct DecodeItem {
  int group = 0;  // G query heads served by each KV head
  // H KV heads of one request computed together (a fused item, shared indices only;
  // DecodeItemFusedAvx512); 1 otherwise. With H > 1 the per-head shapes below gain a
  // leading H: q, gate, out, q_f32, acc: [H * G, D]; lse: [H * G]; k_scale, v_scale:
  // [H, N rounded up to 8]; scores: [H * G, N rounded up to 8]; weights: [H * G, N
  // rounded up to 8] (the fused item keeps the scores' layout); rows are shared and
  // k_layer / v_layer point at the first head.
  int kv_heads = 1;
  int head_dim = 0;       // D
  int num_rows = 0;       // N valid (non-negative) indices, duplicates included, N >= 1
  int prefetch_rows = 0;  // how many rows (token slots) ahead the x86 kernels prefetch
  float inv_sqrt_d = 0.0f;
  bool bf16_scores = false;  // AVX2 kernel: scores with AVX-512 BF16 dot products
  // k_layer, v_layer: the layer's [num_pages * page_size * Hkv, D] FP8 rows, offset by
  // kv_head * D elements.
  const uint8_t* k_layer = nullptr;
  const uint8_t* v_layer = nullptr;
  // rows, k_scale, v_scale: [N rounded up to 8], in index order; the padding repeats
  // the last row (readable memory; its results are discarded).
  // Row n's K codes are k_layer[rows[n] * D, + D) (V likewise): rows hold slot * Hkv
  // and the layer pointers already include the KV head's offset kv_head * D.
  const int64_t* rows = nullptr;
  const float* k_scale = nullptr;  // dequantisation scale of each K row
  const float* v_scale = nullptr;  // dequantisation scale of each V row
  const uint16_t* q = nullptr;     // [G, D] bf16 (the group's query heads)
  const uint16_t* gate = nullptr;  // [G, D] bf16
  uint16_t* out = nullptr;         // [G, D] bf16
  float* lse = nullptr;            // [G] or nullptr
  // Scratch owned by the calling thread.
  float* scores = nullptr;      // [G, N rounded up to 8]
  float* q_f32 = nullptr;       // [G, D]
  float* acc = nullptr;         // [G, D]
  float* row_buffer = nullptr;  // [8, D] floats: dequantised rows (bf16 keys on AVX-512)
  float* weights = nullptr;     // [N rounded up to 8, G] p * v_scale, row-major by row
                                // (fused item: [H * G, N rounded up to 8])

  // Fused items only (DecodeItemFusedAvx512), for small items (V bytes within L2
  // beside K), which otherwise start each pass with a burst of misses that nothing
  // overlaps. prefetch_values_early: the score pass prefetches each tile's V rows.
  // next_*: the fused item that runs next on this thread (same layout as k_layer,
  // v_layer, rows; next_rows == nullptr when none): its K rows are prefetched spread over
  // this item's score pass and its V rows over the value pass, a whole item ahead.
  // rows_prefetched: the previous item did that for this one (no own K/V prefetches).
  bool prefetch_values_early = false;
  const uint8_t* next_k_layer = nullptr;
  const uint8_t* next_v_layer = nullptr;
  const int64_t* next_rows = nullptr;  // [next_num_rows]
  int next_num_rows = 0;
  bool rows_prefetched = false;
};

void DecodeItemPortable(const DecodeItem& item);
// Needs D % 16 == 0 and AVX2/FMA/F16C; bf16_scores also needs D % 32 == 0 and
// AVX-512F/BW/BF16.
void DecodeItemAvx2(const DecodeItem& item);

// The x86 kernels dequantise FP8 through fp16 bits, giving value / 256 (see
// cpu_attention_avx2.cc); the factor is folded back into the scales.
inline constexpr float kFp16CodeScale = 256.0f;
// Fills item.weights [N, heads] (row-major by row) with p * v_scale * kFp16CodeScale from
// item.scores [heads, stride]: the value-pass weights of the x86 kernels.
inline void FillValueWeights(const DecodeItem& item, int heads, int stride) {
  for (int n = 0; n < item.num_rows; ++n)
    for (int h = 0; h < heads; ++h)
      item.weights[n * heads + h] = item.scores[h * stride + n] * item.v_scale[n] * kFp16CodeScale;
}
// How many rows ahead the per-KV-head x86 kernels prefetch K and V.
inline constexpr int kPrefetchRows = 32;

// AVX-512 BF16 parts (cpu_attention_avx512.cc), called from DecodeItemAvx2 only when
// bf16_scores is set. scores: [G, stride] out. TryValuePassAvx512 fills acc [G, D] and
// returns true for G in {1, 2, 4, 8} (with D % 128, 128, 64, 32 == 0), else false.
void ScorePassAvx512Bf16(const DecodeItem& item, int stride);
bool TryValuePassAvx512(const DecodeItem& item, int stride);

// Softmax of scores [G, stride] (lse too) and the gate of acc [G, D] into out: the AVX2
// file's passes (the kAvx2 path's), the bits the AVX-512 passes below must give (their
// tests call these).
void SoftmaxPassX86(const DecodeItem& item, int stride);
void GatePassX86(const DecodeItem& item);
// GatePassX86 sixteen lanes at a time (AVX-512F, G * D % 16 == 0), the same operations per
// element, so the same bits (tests/unit_kernels/gate_pass_test.cc checks every bf16
// gate): out [G, D] = acc [G, D] * sigmoid(gate [G, D]) rounded to bf16. The gate of
// every item on the kAvx512Bf16 path.
void GatePassAvx512(const DecodeItem& item);
// SoftmaxPassX86 sixteen lanes at a time (AVX-512F), the same bits (summed in the AVX2
// order; tests/unit_kernels/softmax_pass_test.cc): the softmax of every item on the
// kAvx512Bf16 path, fused or one KV head at a time.
void SoftmaxPassAvx512(const DecodeItem& item, int stride);

// The fused item (kv_heads >= 1 KV heads sharing one row list, each token slot read once
// for all of them) on the kAvx512Bf16 path; needs FusedItemSupported(G, D) (AVX-512
// VBMI, D % 64 == 0, G in {1, 2, 4} with D % 128 == 0 unless G == 4). Gives the same
// bits as running each KV head alone through DecodeItemAvx2.
bool FusedItemSupported(int group, int head_dim);
void DecodeItemFusedAvx512(const DecodeItem& item);
// Token slots a fused item of kv_heads heads prefetches ahead: 8 KiB of K (or V) at
// 8 x 128 (measured at the seed shape, one thread: 8 slots 5.45 ms per batch, 4 slots
// 5.7 ms, 16-32 slots 5.5-5.6 ms); 32 rows for one head, as the per-head kernels.
inline int FusedPrefetchRows(int kv_heads) {
  const int rows = 64 / kv_heads;
  return rows < 8 ? 8 : rows > 32 ? 32 : rows;
}

// Prefetches the K and V rows of row n (when n < stride) towards L1.
inline void PrefetchRows(const DecodeItem& item, int n, int stride) {
  if (n >= stride) return;
  const int64_t offset = item.rows[n] * item.head_dim;
  for (int byte = 0; byte < item.head_dim; byte += 64) {
    __builtin_prefetch(item.k_layer + offset + byte, 0, 3);
    __builtin_prefetch(item.v_layer + offset + byte, 0, 3);
  }
}

// Constants of exp(x) for x <= 0, shared by the scalar, AVX2 and AVX-512 versions (they
// must agree bit for bit): clamp, log2(e), ln 2 split into an exact high part and the
// rest, and the polynomial of exp(r) - 1 - r over r^2 (highest degree first).
inline constexpr float kExpClamp = -87.0f;
inline constexpr float kExpLog2e = 1.44269504088896341f;
inline constexpr float kExpLn2Hi = 0.693359375f;
inline constexpr float kExpLn2Lo = -2.12194440e-4f;
inline constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0 (inputs below -87 give ~1e-38), within ~2 float ulps. Scalar
// companion of the vector versions in the AVX2 and AVX-512 kernels.
inline float ExpNonPositive(float x) {
  x = x < kExpClamp ? kExpClamp : x;
  const float n = (x * kExpLog2e + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  float r = x - n * kExpLn2Hi;                                  // exact product: n has <= 7 bits
  r = r - n * kExpLn2Lo;
  float poly = kExpPoly[0];
  for (int i = 1; i < 6; ++i) poly = poly * r + kExpPoly[i];
  const float exp_r = poly * r * r + r + 1.0f;
  return exp_r * BitsToFloat(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// 1 / (1 + exp(-x)) without overflow.
inline float Sigmoid(float x) {
  const float e = ExpNonPositive(x >= 0.0f ? -x : x);  // exp(-|x|)
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

}  // namespace sds::cpu_internal
