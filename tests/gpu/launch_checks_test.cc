// Host-side checks of the CUDA kernels' launch API that run without a GPU (ctest label
// `cuda_host`, not `gpu`): what LaunchDecode refuses before it launches anything.
#include <gtest/gtest.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/decode_params.h"

namespace sds {
namespace {

// A small cache of head_dim `head_dim`: 1 layer, 2 KV heads, 10 pages of 16.
CacheGeometry SmallGeometry(int32_t head_dim) {
  CacheGeometry geo;
  geo.num_layers = 1;
  geo.num_kv_heads = 2;
  geo.head_dim = head_dim;
  geo.page_size = 16;
  geo.num_pages = 10;
  return geo;
}

// Shapes the CUDA decode does not support are INVALID_ARGUMENT.
TEST(DecodeShapes, UnsupportedShapesAreClearErrors) {
  CacheGeometry geo = SmallGeometry(96);
  EXPECT_EQ(cuda::CheckDecodeShape(8, geo).code(), absl::StatusCode::kInvalidArgument);
  geo.head_dim = 128;
  EXPECT_TRUE(cuda::CheckDecodeShape(8, geo).ok());
  EXPECT_EQ(cuda::CheckDecodeShape(34, geo).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::CheckDecodeShape(7, geo).code(), absl::StatusCode::kInvalidArgument);
}

// The kernels read q (16 bytes in v2) and gate and write out 8 bytes at a time, and the
// split-K partials 16: a misaligned pointer is refused before anything is launched
// (INVALID_ARGUMENT, not a fault that would take the context with it). The pointers are never
// dereferenced on the host and nothing reaches the device.
TEST(DecodeShapes, MisalignedInputsAreClearErrors) {
  CacheView cache;
  cache.geo = SmallGeometry(128);
  // Host stand-ins for the device pointers: only their addresses are checked.
  alignas(64) static float storage[64];
  char* base = reinterpret_cast<char*>(storage);
  auto bf16_at = [&](int offset) { return reinterpret_cast<const uint16_t*>(base + offset); };
  DecodeBatch batch;
  batch.num_requests = 1;
  batch.num_q_heads = 8;
  batch.q = bf16_at(0);
  batch.gate = bf16_at(64);
  cuda::DecodeWorkspace ws;
  ws.partial = storage + 32;
  ws.capacity_floats = 1 << 20;
  auto launch = [&] { return cuda::LaunchDecode(cache, batch, 16, ws, nullptr); };
  batch.q = bf16_at(2);
  EXPECT_EQ(launch().code(), absl::StatusCode::kInvalidArgument) << "q";
  batch.q = bf16_at(0);
  batch.gate = bf16_at(68);
  EXPECT_EQ(launch().code(), absl::StatusCode::kInvalidArgument) << "gate";
  batch.gate = bf16_at(64);
  ws.partial = storage + 34;  // 8 bytes past a 16-byte boundary
  EXPECT_EQ(launch().code(), absl::StatusCode::kInvalidArgument) << "workspace";
  ws.partial = storage + 32;
  batch.out = reinterpret_cast<uint16_t*>(base + 132);  // 4 bytes past an 8-byte boundary
  EXPECT_EQ(launch().code(), absl::StatusCode::kInvalidArgument) << "out";
  // v2 reads q 16 bytes at a time: 8 past a 16-byte boundary is refused there.
  batch.out = reinterpret_cast<uint16_t*>(base + 128);
  batch.q = bf16_at(8);
  EXPECT_EQ(cuda::LaunchDecode(cache, batch, 16, ws, nullptr, cuda::DecodeKernel::kV2).code(),
            absl::StatusCode::kInvalidArgument)
      << "q for v2";
}

}  // namespace
}  // namespace sds
