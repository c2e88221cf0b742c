// Helper kernels of the GPU benchmark: a read-only bandwidth pass and random fills.
#include "bench/gpu/bench_kernels.h"

namespace sds::cudabench {
namespace {

// data: [n16] 16-byte words; sink: [gridDim * blockDim], written only if the XOR is a magic value.
__global__ void ReadPassKernel(const uint4* __restrict__ data, int64_t n16, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = __ldcs(data + i), b = __ldcs(data + i + stride);
    const uint4 c = __ldcs(data + i + 2 * stride), d = __ldcs(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^
           d.w;
  }
  for (; i < n16; i += stride) {
    const uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// out: [n] bytes, random E4M3 codes of moderate magnitude (never NaN).
__global__ void FillFp8Kernel(uint8_t* out, int64_t n, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i * 4 < n;
       i += stride) {
    const uint32_t h = Hash(seed * 0x9E3779B97F4A7C15ULL + i);
    // exponent field 4..10 (values ~2^-3 .. 2^3), random sign and mantissa.
    uint32_t word = 0;
    for (int b = 0; b < 4; ++b) {
      const uint32_t r = (h >> (8 * b)) & 0xFF;
      const uint32_t code = (r & 0x80) | ((4 + (r >> 3) % 7) << 3) | (r & 7);
      word |= code << (8 * b);
    }
    if (i * 4 + 3 < n) {
      reinterpret_cast<uint32_t*>(out)[i] = word;
    } else {
      for (int b = 0; i * 4 + b < n; ++b) out[i * 4 + b] = (word >> (8 * b)) & 0xFF;
    }
  }
}

// Gathers rows: row_ids: [n_rows] (each row read once); rows of row_bytes bytes.
__global__ void GatherKernel(const uint4* __restrict__ base, const int32_t* __restrict__ row_ids,
                             int64_t n_rows, int pieces_per_row, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t total = n_rows * pieces_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < total; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t piece = i + u * stride;
      const int64_t row = row_ids[piece / pieces_per_row];
      v[u] = __ldcs(base + row * pieces_per_row + piece % pieces_per_row);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < total; i += stride) {
    const uint4 a =
        __ldcs(base + static_cast<int64_t>(row_ids[i / pieces_per_row]) * pieces_per_row +
               i % pieces_per_row);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__global__ void EmptyKernel() {}

}  // namespace

cudaError_t Empty(cudaStream_t stream) {
  EmptyKernel<<<1, 32, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t Gather(const void* base, const int32_t* row_ids, int64_t n_rows, int row_bytes,
                   uint32_t* sink, int blocks, cudaStream_t stream) {
  GatherKernel<<<blocks, 512, 0, stream>>>(static_cast<const uint4*>(base), row_ids, n_rows,
                                           row_bytes / 16, sink);
  return cudaGetLastError();
}

cudaError_t ReadPass(const void* data, int64_t bytes, uint32_t* sink, int blocks,
                     cudaStream_t stream) {
  ReadPassKernel<<<blocks, 512, 0, stream>>>(static_cast<const uint4*>(data), bytes / 16, sink);
  return cudaGetLastError();
}

cudaError_t FillFp8(uint8_t* out, int64_t n, uint64_t seed, cudaStream_t stream) {
  FillFp8Kernel<<<1024, 256, 0, stream>>>(out, n, seed);
  return cudaGetLastError();
}

}  // namespace sds::cudabench
