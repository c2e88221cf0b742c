// Device stages of the rows whose tensors are in a runner's device memory (CUDA IPC,
// DeviceRowSource in decode_params.h): gather them into the batch's arrays while checking
// them, before the append; scatter their answers back after the decode. Host rows
// (source q == nullptr) are left alone by both.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/decode_params.h"

namespace sds::cuda {

struct GatherRowsParams {
  int32_t num_rows = 0;  // B
  int32_t num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  const DeviceRowSource* rows = nullptr;         // [B] (device copy)
  uint16_t* q = nullptr;                         // [B, Hq, D] bf16
  uint16_t* gate = nullptr;                      // [B, Hq, D] bf16
  uint16_t* k_new = nullptr;                     // [B, Hkv, D] bf16 (append row b = decode row b)
  uint16_t* v_new = nullptr;                     // [B, Hkv, D] bf16
  int32_t* indices = nullptr;                    // flat; row b's list(s) at index_offset[b]
  const int64_t* index_offset = nullptr;         // [B]
  const int32_t* topk = nullptr;                 // [B]
  const uint8_t* indices_per_kv_head = nullptr;  // [B]
  int64_t* slot = nullptr;                       // [B] append slots: set to -1 for an invalid row
  uint8_t* row_error = nullptr;                  // [B]: kRowOk, kRowNonFinite or kRowBadIndex
};

struct ScatterRowsParams {
  int32_t num_rows = 0;
  int32_t num_q_heads = 0, head_dim = 0;
  const DeviceRowSource* rows = nullptr;  // [B] (device copy)
  const uint16_t* out = nullptr;          // [B, Hq, D] bf16, the decode's
  const float* lse = nullptr;             // [B, Hq] float32 or nullptr
  const uint8_t* row_error = nullptr;     // [B]: rows found invalid are not written
};

// One CTA per row. An invalid row (a NaN or Inf in q, gate, k or v; an index outside
// [-1, position]) gets every index -1 and slot -1, so that the append stores nothing and
// the decode reads nothing for it.
cudaError_t EnqueueGatherDeviceRows(const GatherRowsParams& params, cudaStream_t stream);
cudaError_t EnqueueScatterDeviceOutputs(const ScatterRowsParams& params, cudaStream_t stream);

}  // namespace sds::cuda
