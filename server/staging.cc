#include "server/staging.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/sigbus_guard.h"

namespace sds::server {
namespace {

constexpr size_t kAlign = 256;
constexpr size_t kIndexAlign = 16;  // int32 slots: each list starts on a 64-byte line

size_t AlignUp(size_t n, size_t unit = kAlign) { return (n + unit - 1) / unit * unit; }

// Lays arrays out one after another in one block; first pass sizes, second carves.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* Take(int64_t count) {
    T* ptr = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += AlignUp(static_cast<size_t>(count) * sizeof(T));
    return ptr;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace

StagingBuffer::StagingBuffer(Backend* backend, const ModelShape& model, int32_t max_batch_size)
    : backend_(backend), model_(model), max_batch_(max_batch_size) {
  index_stride_ = static_cast<int64_t>(model.num_kv_heads) * model.max_topk;
}

absl::StatusOr<std::unique_ptr<StagingBuffer>> StagingBuffer::Create(Backend* backend,
                                                                     const ModelShape& model,
                                                                     int32_t max_batch_size) {
  std::unique_ptr<StagingBuffer> buf(new StagingBuffer(backend, model, max_batch_size));
  const int64_t b = max_batch_size;
  const int64_t q_elems = b * model.num_q_heads * model.head_dim;
  const int64_t kv_elems = b * model.num_kv_heads * model.head_dim;
  auto carve = [&](Carver& c) {
    buf->q_ = c.Take<uint16_t>(q_elems);
    buf->gate_ = c.Take<uint16_t>(q_elems);
    buf->k_new_ = c.Take<uint16_t>(kv_elems);
    buf->v_new_ = c.Take<uint16_t>(kv_elems);
    buf->append_layer_ = c.Take<int32_t>(b);
    buf->slot_ = c.Take<int64_t>(b);
    buf->layer_ = c.Take<int32_t>(b);
    buf->indices_ = c.Take<int32_t>(b * (buf->index_stride_ + static_cast<int64_t>(kIndexAlign)));
    buf->index_offset_ = c.Take<int64_t>(b);
    buf->topk_ = c.Take<int32_t>(b);
    buf->indices_per_kv_head_ = c.Take<uint8_t>(b);
    buf->page_table_offset_ = c.Take<int64_t>(b);
    buf->out_ = c.Take<uint16_t>(q_elems);
    buf->lse_ = c.Take<float>(b * model.num_q_heads);
    buf->device_rows_ = c.Take<DeviceRowSource>(b);
    buf->row_error_ = c.Take<uint8_t>(b);
    buf->fill_failed_ = c.Take<uint8_t>(b);
  };
  Carver sizing(nullptr);
  carve(sizing);
  buf->block_ = backend->AllocateStaging(sizing.used());
  if (buf->block_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", sizing.used(), " bytes of staging memory"));
  }
  Carver real(static_cast<char*>(buf->block_));
  carve(real);
  if (absl::Status s = buf->ReservePageTable(b * 64); !s.ok()) return s;
  return buf;
}

StagingBuffer::~StagingBuffer() {
  if (block_) backend_->FreeStaging(block_);
  if (page_table_) backend_->FreeStaging(page_table_);
}

absl::Status StagingBuffer::ReservePageTable(int64_t count) {
  if (count <= page_table_capacity_) return absl::OkStatus();
  const int64_t capacity = std::max(count, page_table_capacity_ * 2);
  void* ptr = backend_->AllocateStaging(static_cast<size_t>(capacity) * sizeof(int32_t));
  if (ptr == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a staging page table of ", capacity, " entries"));
  }
  if (page_table_) {
    // The executor grows the table while it fills it, row after row: the rows already
    // written keep their page ids.
    std::memcpy(ptr, page_table_, static_cast<size_t>(page_table_capacity_) * sizeof(int32_t));
    backend_->FreeStaging(page_table_);
  }
  page_table_ = static_cast<int32_t*>(ptr);
  page_table_capacity_ = capacity;
  return absl::OkStatus();
}

int64_t StagingBuffer::IndexSlots(const DecodeTensorBytes& bytes) {
  const size_t count = bytes.device != nullptr
                           ? static_cast<size_t>(bytes.device_index_count)
                           : AlignUp(bytes.indices.size(), sizeof(int32_t)) / sizeof(int32_t);
  return static_cast<int64_t>(AlignUp(count, kIndexAlign));
}

void StagingBuffer::FillRow(int32_t row, const DecodeItem& item) {
  const DecodeTensorBytes& bytes = item.bytes;
  const int64_t q_row = static_cast<int64_t>(model_.num_q_heads) * model_.head_dim;
  const int64_t kv_row = static_cast<int64_t>(model_.num_kv_heads) * model_.head_dim;
  // Validated sizes: q and gate [Hq, D], k and v [Hkv, D], indices K or Hkv * K int32.
  // A row on the device copies nothing here: the backend gathers it (device_rows_).
  device_rows_[row] = bytes.device != nullptr ? *bytes.device : DeviceRowSource{};
  fill_failed_[row] = 0;
  if (bytes.device == nullptr) {
    // Views into a client's shared memory may have lost their pages (sigbus_guard.h).
    const bool copied = RunGuarded([&] {
      bytes.q.CopyTo(q_ + row * q_row);
      bytes.gate.CopyTo(gate_ + row * q_row);
      bytes.k.CopyTo(k_new_ + row * kv_row);
      bytes.v.CopyTo(v_new_ + row * kv_row);
      bytes.indices.CopyTo(indices_ + index_offset_[row]);  // placed by PlanIndices
    });
    fill_failed_[row] = copied ? 0 : 1;
  }
  layer_[row] = item.layer;
  append_layer_[row] = item.layer;
  topk_[row] = item.topk;
  indices_per_kv_head_[row] = item.indices_per_kv_head ? 1 : 0;
}

void StagingBuffer::MoveRow(int32_t dst, int32_t src) {
  const int64_t q_row = static_cast<int64_t>(model_.num_q_heads) * model_.head_dim;
  const int64_t kv_row = static_cast<int64_t>(model_.num_kv_heads) * model_.head_dim;
  std::memcpy(q_ + dst * q_row, q_ + src * q_row, q_row * 2);
  std::memcpy(gate_ + dst * q_row, gate_ + src * q_row, q_row * 2);
  std::memcpy(k_new_ + dst * kv_row, k_new_ + src * kv_row, kv_row * 2);
  std::memcpy(v_new_ + dst * kv_row, v_new_ + src * kv_row, kv_row * 2);
  layer_[dst] = layer_[src];
  append_layer_[dst] = append_layer_[src];
  slot_[dst] = slot_[src];
  index_offset_[dst] = index_offset_[src];  // the index list itself stays where it is
  topk_[dst] = topk_[src];
  indices_per_kv_head_[dst] = indices_per_kv_head_[src];
  device_rows_[dst] = device_rows_[src];
}

void StagingBuffer::Describe(int32_t rows, BatchWork* work) const {
  work->append.num_tokens = rows;
  work->append.k_new = k_new_;
  work->append.v_new = v_new_;
  work->append.layer = append_layer_;
  work->append.slot = slot_;
  DecodeBatch& d = work->decode;
  d.num_requests = rows;
  d.num_q_heads = model_.num_q_heads;
  d.q = q_;
  d.gate = gate_;
  d.layer = layer_;
  d.page_table = page_table_;
  d.page_table_offset = page_table_offset_;
  d.indices = indices_;
  d.index_offset = index_offset_;
  d.topk = topk_;
  d.indices_per_kv_head = indices_per_kv_head_;
  d.out = out_;
  d.lse = lse_;
  d.device_rows = nullptr;
  d.row_error = row_error_;
  std::memset(row_error_, kRowOk, static_cast<size_t>(rows));
  for (int32_t row = 0; row < rows; ++row) {
    if (device_rows_[row].q != nullptr) {
      d.device_rows = device_rows_;
      break;
    }
  }
}

const uint16_t* StagingBuffer::out_row(int32_t row) const {
  return out_ + static_cast<int64_t>(row) * model_.num_q_heads * model_.head_dim;
}

const float* StagingBuffer::lse_row(int32_t row) const {
  return lse_ + static_cast<int64_t>(row) * model_.num_q_heads;
}

}  // namespace sds::server
