// Plain parameter structs shared by every attention implementation (CPU and CUDA).
// No gRPC, no server types. Every pointer states its shape; bf16 travels as its raw
// 16-bit pattern (uint16_t), FP8 E4M3FN as its raw byte (uint8_t). Pointers live in
// the memory space of the implementation that receives the struct (host for the CPU
// kernels, device for the CUDA kernels).
#pragma once

#include <cstdint>

namespace sds {

enum class ScaleMode : int32_t {
  kPerTensor = 0,    // one float32 k/v scale per layer
  kPerTokenHead = 1  // scale = max|x| / 448 per (token, KV head), stored beside the page
};

// Shape of the paged cache. A page id indexes the same page in every layer.
struct CacheGeometry {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;  // Hkv
  int32_t head_dim = 0;      // D
  int32_t page_size = 0;     // tokens per page, a power of two
  int64_t num_pages = 0;
  ScaleMode scale_mode = ScaleMode::kPerTensor;

  // Elements of one layer's K (or V) array: num_pages * page_size * Hkv * D.
  int64_t LayerElements() const {
    return num_pages * page_size * static_cast<int64_t>(num_kv_heads) * head_dim;
  }
  // Scales of one layer's K (or V) scale array: num_pages * page_size * Hkv.
  int64_t LayerScales() const { return num_pages * page_size * static_cast<int64_t>(num_kv_heads); }
};

// A view of the paged FP8 cache. A token slot is page_id * page_size + offset_in_page.
struct CacheView {
  CacheGeometry geo;
  // k, v: [num_layers, num_pages, page_size, Hkv, D] FP8 E4M3FN bytes.
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  // k_token_scale, v_token_scale: [num_layers, num_pages, page_size, Hkv] float32;
  // per_token_head mode only, nullptr otherwise.
  float* k_token_scale = nullptr;
  float* v_token_scale = nullptr;
  // layer_k_scale, layer_v_scale: [num_layers] float32; per_tensor mode only.
  const float* layer_k_scale = nullptr;
  const float* layer_v_scale = nullptr;
};

// New K/V rows to quantise into the cache (decode's new tokens and prefill alike).
struct AppendBatch {
  int32_t num_tokens = 0;  // N
  // k_new, v_new: [N, Hkv, D] bf16 bits.
  const uint16_t* k_new = nullptr;
  const uint16_t* v_new = nullptr;
  // layer: [N] int32, the layer each row goes to.
  const int32_t* layer = nullptr;
  // slot: [N] int64, page_id * page_size + offset_in_page (already allocated).
  const int64_t* slot = nullptr;
};

// A decode request whose tensors lie in device memory that the server does not own (a
// runner's allocation opened through CUDA IPC): a backend that reads device memory
// gathers them into its batch arrays on the device, checks them there (finite values,
// indices in [-1, position]) and writes the answer back on the device.
struct DeviceRowSource {
  const uint16_t* q = nullptr;     // [Hq, D] bf16, 16-byte aligned; nullptr: a host row
  const uint16_t* gate = nullptr;  // [Hq, D] bf16, 16-byte aligned
  const uint16_t* k = nullptr;     // [Hkv, D] bf16, the new token's, 16-byte aligned
  const uint16_t* v = nullptr;     // [Hkv, D] bf16, 16-byte aligned
  // The request's K_b indices, or Hkv lists of K_b ([Hkv, K_b]), list h starting at
  // indices + h * index_stride (int32 elements).
  const int32_t* indices = nullptr;
  int64_t index_stride = 0;
  int64_t position = 0;     // the token's position: indices must be -1 or in [0, position]
  uint16_t* out = nullptr;  // [Hq, D] bf16 on the device; nullptr: answered from the host copy
  float* lse = nullptr;     // [Hq] float32 on the device; nullptr: none there
};

// DecodeBatch::row_error values.
inline constexpr uint8_t kRowOk = 0;
inline constexpr uint8_t kRowNonFinite = 1;  // NaN or Inf in q, gate, k or v
inline constexpr uint8_t kRowBadIndex = 2;   // an index outside [-1, position]

// One batched sparse top-K GQA decode with fused sigmoid gate. Requests may mix
// sequences, layers and top-K lengths. Query head h reads KV head h / G, G = Hq / Hkv.
// Indices are validated by the caller: each is -1 (skip) or a logical position whose
// page exists in the request's page table.
struct DecodeBatch {
  int32_t num_requests = 0;  // B
  int32_t num_q_heads = 0;   // Hq, a multiple of the cache's Hkv
  // q, gate: [B, Hq, D] bf16 bits.
  const uint16_t* q = nullptr;
  const uint16_t* gate = nullptr;
  // layer: [B] int32.
  const int32_t* layer = nullptr;
  // page_table: flat int32 page ids; request b's logical page j is
  // page_table[page_table_offset[b] + j]. page_table_offset: [B] int64.
  const int32_t* page_table = nullptr;
  const int64_t* page_table_offset = nullptr;
  // indices: flat int32; request b's list starts at indices[index_offset[b]] and is
  // [K_b] when indices_per_kv_head[b] == 0 (shared by all heads) or [Hkv, K_b]
  // (row-major) when it is 1. index_offset: [B] int64; topk: [B] int32 (K_b >= 0);
  // indices_per_kv_head: [B] uint8.
  const int32_t* indices = nullptr;
  const int64_t* index_offset = nullptr;
  const int32_t* topk = nullptr;
  const uint8_t* indices_per_kv_head = nullptr;
  // out: [B, Hq, D] bf16 bits, every element written (0 for a row with no valid index).
  uint16_t* out = nullptr;
  // lse: [B, Hq] float32, natural log, -inf for a row with no valid index; may be nullptr.
  float* lse = nullptr;
  // device_rows: [B] host array, or nullptr when every row's tensors are in the arrays
  // above. Row b with device_rows[b].q != nullptr has its q, gate, new K/V (append row b)
  // and index list on the device instead (the arrays above hold no data for it), and
  // row_error[b] ([B] host, written by the backend) says whether they were valid; an
  // invalid row stores nothing and its outputs are not written. Only a backend that
  // reads device memory accepts such rows.
  const DeviceRowSource* device_rows = nullptr;
  uint8_t* row_error = nullptr;
};

}  // namespace sds
