// FP8 E4M3FN and bf16 conversions shared by the CPU and CUDA kernels, so that both
// quantise bit-identically. Header only; no CUDA headers are needed on the host.
//
// E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F/0xFF are
// NaN; largest finite magnitude 448 (0x7E), smallest subnormal 2^-9.
// Encoding rounds to nearest even and saturates: |x| > 448 (and +-inf) gives +-448.
// NaN encodes as 0x7F (the sign is kept).
#pragma once

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

#if defined(__CUDACC__)
#define SDS_HOST_DEVICE __host__ __device__
#else
#define SDS_HOST_DEVICE
#endif

namespace sds {

inline constexpr float kFp8E4m3Max = 448.0f;

SDS_HOST_DEVICE inline uint32_t FloatToBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

SDS_HOST_DEVICE inline float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

// bf16 bits -> float (exact).
SDS_HOST_DEVICE inline float Bf16ToFloat(uint16_t bits) {
  return BitsToFloat(static_cast<uint32_t>(bits) << 16);
}

// float -> bf16 bits, round to nearest even; NaN -> 0x7FC0 with the sign kept.
SDS_HOST_DEVICE inline uint16_t FloatToBf16(float x) {
  const uint32_t bits = FloatToBits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x7FC0u);
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// Shifts `magnitude` right by `shift` (1..31) rounding to nearest, ties to even.
SDS_HOST_DEVICE inline uint32_t ShiftRightRoundEven(uint32_t magnitude, uint32_t shift) {
  const uint32_t kept = magnitude >> shift;
  const uint32_t remainder = magnitude & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return kept + ((remainder > half || (remainder == half && (kept & 1u))) ? 1u : 0u);
}

// float -> E4M3FN byte (round to nearest even, saturating to +-448, NaN -> 0x7F).
SDS_HOST_DEVICE inline uint8_t FloatToFp8E4m3(float x) {
  const uint32_t bits = FloatToBits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN
  const uint32_t biased_exponent = magnitude >> 23;                        // float bias 127
  uint32_t code;
  if (biased_exponent >= 121) {
    // |x| >= 2^-6: normal in E4M3. Drop 20 mantissa bits; a carry bumps the exponent.
    // Exponents above 2^8 (and inf) are clamped first so the shift cannot overflow.
    if (biased_exponent > 127 + 8) return static_cast<uint8_t>(sign | 0x7Eu);
    code = ShiftRightRoundEven(magnitude, 20) - ((127u - 7u) << 3);
  } else {
    // |x| < 2^-6: subnormal in E4M3, code = round(|x| / 2^-9) (8 means 2^-6, also right).
    if (biased_exponent == 0) return sign;  // float zero or subnormal: far below 2^-10
    const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;  // 24 bits
    const uint32_t shift = 141u - biased_exponent;                     // >= 21
    code = shift > 25u ? 0u : ShiftRightRoundEven(significand, shift);
  }
  if (code > 0x7Eu) code = 0x7Eu;  // saturate (0x7F would be NaN)
  return static_cast<uint8_t>(sign | code);
}

// E4M3FN byte -> float (exact; NaN for 0x7F/0xFF).
SDS_HOST_DEVICE inline float Fp8E4m3ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xFu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return BitsToFloat(sign | 0x7FC00000u);
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);  // exact
    return sign ? -magnitude : magnitude;
  }
  return BitsToFloat(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// Exact IEEE float division, also under --use_fast_math on the device.
SDS_HOST_DEVICE inline float DivideRoundNearest(float numerator, float denominator) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(numerator, denominator);
#else
  return numerator / denominator;
#endif
}

// per_token_head scale of one (token, KV head) row from its max |x| (float32):
// max|x| / 448, and 1.0 for an all-zero row. A quotient that underflows to zero
// (max|x| below ~3e-43) also gives 1.0, so x / scale never divides by zero.
SDS_HOST_DEVICE inline float PerTokenHeadScale(float max_abs) {
  const float scale = DivideRoundNearest(max_abs, kFp8E4m3Max);
  return scale == 0.0f ? 1.0f : scale;
}

// stored = fp8(x / scale), true IEEE division (both scale modes).
SDS_HOST_DEVICE inline uint8_t QuantiseFp8E4m3(float x, float scale) {
  return FloatToFp8E4m3(DivideRoundNearest(x, scale));
}

}  // namespace sds
