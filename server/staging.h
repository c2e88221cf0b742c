// Host staging buffers of one decode batch, allocated through Backend::AllocateStaging
// (pinned on CUDA). The assembler copies each item's tensors straight from where its
// call received them (wire slices or shared memory) into a row; the executor fills the
// cache metadata (slots, page tables) and hands the pointers to the backend.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/backend.h"
#include "server/model_shape.h"
#include "server/tensor_bytes.h"
#include "server/work.h"

namespace sds::server {

class StagingBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<StagingBuffer>> Create(Backend* backend,
                                                               const ModelShape& model,
                                                               int32_t max_batch_size);
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  // int32 slots a validated request's index list takes in the batch's packed index array:
  // its K or Hkv * K indices, rounded up to 16 (each list starts on a 64-byte line).
  static int64_t IndexSlots(const DecodeTensorBytes& bytes);
  // Places the index lists of rows [0, rows) back to back: row r's list starts at the
  // sum of IndexSlots(bytes_of(j)) over j < r (bytes_of: row -> its validated
  // DecodeTensorBytes). Call it on one thread before the rows' FillRow calls. A backend
  // copies the span from the first list to the end of the last: with one 64 KB stride
  // per row (Hkv * max_topk at the seed shape) a batch of 256 uploaded 16.7 MB of
  // indices instead of 0.5 MB, 430 us of its device time on the H200.
  template <typename BytesOf>
  void PlanIndices(int32_t rows, BytesOf bytes_of) {
    int64_t at = 0;
    for (int32_t row = 0; row < rows; ++row) {
      index_offset_[row] = at;
      at += IndexSlots(bytes_of(row));
    }
  }
  // Copies q, gate, k, v and the indices of a checked item into row `row`; its index
  // list to where PlanIndices placed it. Rows may be filled on several threads at once.
  void FillRow(int32_t row, const DecodeItem& item);
  // Moves row `src` to row `dst` (dst < src) to close the gap of a failed request.
  void MoveRow(int32_t dst, int32_t src);
  // Makes room for `count` page ids; may reallocate page_table, keeping its entries.
  absl::Status ReservePageTable(int64_t count);

  // Points `work` at the first `rows` rows (append rows = decode rows).
  void Describe(int32_t rows, BatchWork* work) const;

  const uint16_t* out_row(int32_t row) const;  // [Hq, D] bf16
  const float* lse_row(int32_t row) const;     // [Hq]
  // True when FillRow could not read row `row`'s tensors (their shared memory lost its
  // pages): the row must not run. Valid until the rows are moved.
  bool fill_failed(int32_t row) const { return fill_failed_[row] != 0; }
  // The backend's verdict on row `row`'s device tensors after Run (DecodeBatch::row_error).
  uint8_t row_error(int32_t row) const { return row_error_[row]; }
  // Whether row `row` had its tensors on the device, answered there when its source has
  // an `out` (DeviceRowSource).
  const DeviceRowSource& device_row(int32_t row) const { return device_rows_[row]; }
  int32_t* append_layer() { return append_layer_; }
  int64_t* slot() { return slot_; }
  int32_t* page_table() { return page_table_; }
  int64_t* page_table_offset() { return page_table_offset_; }
  int32_t max_batch_size() const { return max_batch_; }

 private:
  StagingBuffer(Backend* backend, const ModelShape& model, int32_t max_batch_size);

  Backend* backend_;
  ModelShape model_;
  int32_t max_batch_;
  int64_t index_stride_ = 0;  // Hkv * max_topk: the most indices a row can have
  void* block_ = nullptr;
  // Row-major [max_batch, ...] arrays carved out of block_ (shapes in decode_params.h).
  uint16_t* q_ = nullptr;
  uint16_t* gate_ = nullptr;
  uint16_t* k_new_ = nullptr;
  uint16_t* v_new_ = nullptr;
  int32_t* append_layer_ = nullptr;
  int64_t* slot_ = nullptr;
  int32_t* layer_ = nullptr;
  int32_t* indices_ = nullptr;
  int64_t* index_offset_ = nullptr;
  int32_t* topk_ = nullptr;
  uint8_t* indices_per_kv_head_ = nullptr;
  int64_t* page_table_offset_ = nullptr;
  uint16_t* out_ = nullptr;
  float* lse_ = nullptr;
  DeviceRowSource* device_rows_ = nullptr;  // [max_batch]: q == nullptr for a host row
  uint8_t* row_error_ = nullptr;            // [max_batch]
  uint8_t* fill_failed_ = nullptr;          // [max_batch], set by FillRow
  // Separately allocated, grows on demand.
  int32_t* page_table_ = nullptr;
  int64_t page_table_capacity_ = 0;
};

}  // namespace sds::server
