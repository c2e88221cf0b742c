// Helper kernels of the GPU benchmark.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>

namespace sds::cudabench {

// bf16 bits of a finite x, rounded to nearest even (host).
inline uint16_t Bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// Reads `bytes` (a multiple of 16) of `data` once; sink: [blocks * 512] uint32.
cudaError_t ReadPass(const void* data, int64_t bytes, uint32_t* sink, int blocks,
                     cudaStream_t stream);
// Reads rows row_ids[0..n_rows) of `base` (rows of row_bytes bytes, a multiple of 16).
cudaError_t Gather(const void* base, const int32_t* row_ids, int64_t n_rows, int row_bytes,
                   uint32_t* sink, int blocks, cudaStream_t stream);
// One empty 32-thread block (launch floor of the timing method).
cudaError_t Empty(cudaStream_t stream);
// out: [n] random E4M3 bytes with magnitudes 2^-3..2^3 (no NaN codes).
cudaError_t FillFp8(uint8_t* out, int64_t n, uint64_t seed, cudaStream_t stream);

}  // namespace sds::cudabench
