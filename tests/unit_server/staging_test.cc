// StagingBuffer (server/staging.h): the rows a batch's requests are copied into and how
// the backend sees them. The index lists of a batch must lie back to back (a backend
// copies the span from the first list to the end of the last one to the device), a
// full batch of the longest lists must fit, and a moved row must keep its list.
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend.h"
#include "server/model_shape.h"
#include "server/staging.h"
#include "server/tensor_bytes.h"
#include "server/validate.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

constexpr int kD = 64;

template <typename T>
void SetTensor(v1::Tensor* t, v1::DType dtype, const std::vector<int64_t>& shape,
               const std::vector<T>& values) {
  t->set_dtype(dtype);
  for (int64_t dim : shape) t->add_shape(dim);
  t->set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
}

// A request of a model with hq / hkv heads: random bf16 tensors and `lists` index lists
// of `k` random positions (some -1); lists > 1 sends the [Hkv, K] form.
v1::DecodeRequest RandomRequest(std::mt19937& rng, int hq, int hkv, int lists, int k) {
  std::uniform_int_distribution<int> bits(0x3c00, 0x4400);  // bf16 of ~0.008 .. 512
  auto bf16 = [&](int n) {
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v) x = static_cast<uint16_t>(bits(rng) | (rng() & 1 ? 0x8000 : 0));
    return v;
  };
  std::uniform_int_distribution<int32_t> position(-1, 999);
  std::vector<int32_t> indices(static_cast<size_t>(lists) * k);
  for (int32_t& i : indices) i = position(rng);
  v1::DecodeRequest request;
  SetTensor(request.mutable_q(), v1::BF16, {hq, kD}, bf16(hq * kD));
  SetTensor(request.mutable_gate(), v1::BF16, {hq, kD}, bf16(hq * kD));
  SetTensor(request.mutable_k(), v1::BF16, {hkv, kD}, bf16(hkv * kD));
  SetTensor(request.mutable_v(), v1::BF16, {hkv, kD}, bf16(hkv * kD));
  if (lists == 1) {
    SetTensor(request.mutable_indices(), v1::INT32, {k}, indices);
  } else {
    SetTensor(request.mutable_indices(), v1::INT32, {lists, k}, indices);
  }
  return request;
}

// A CPU backend (for its staging memory) and a staging buffer of `batch` rows.
struct Fixture {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<StagingBuffer> staging;
};
Fixture Make(int hq, int hkv, int max_topk, int batch) {
  const BackendConfig config = {.cache = {.num_layers = 1,
                                          .num_kv_heads = hkv,
                                          .head_dim = kD,
                                          .page_size = 16,
                                          .num_pages = 16,
                                          .scale_mode = ScaleMode::kPerTensor,
                                          .layer_k_scales = {},
                                          .layer_v_scales = {}},
                                .num_q_heads = hq,
                                .max_batch_size = batch,
                                .max_topk = max_topk,
                                .cpu_threads = 1};
  Fixture f;
  auto backend = CreateCpuBackend(config);
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return f;
  f.backend = *std::move(backend);
  auto staging =
      StagingBuffer::Create(f.backend.get(), ModelShape{1, hq, hkv, kD, max_topk}, batch);
  EXPECT_TRUE(staging.ok()) << staging.status();
  if (staging.ok()) f.staging = *std::move(staging);
  return f;
}

// Plans and fills rows [0, n) from `requests` as the batcher does (their items as
// ValidateDecode describes them, without its value checks: the indices are random).
void Fill(StagingBuffer& staging, const std::vector<v1::DecodeRequest>& requests) {
  std::vector<DecodeItem> items(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const v1::DecodeRequest& r = requests[i];
    const v1::Tensor& indices = r.indices();
    items[i].layer = r.layer();
    items[i].indices_per_kv_head = indices.shape_size() == 2;
    items[i].topk = static_cast<int32_t>(indices.shape(indices.shape_size() - 1));
    items[i].bytes = DecodeBytesOf(r);
  }
  const auto n = static_cast<int32_t>(requests.size());
  staging.PlanIndices(n, [&](int32_t row) -> const DecodeTensorBytes& { return items[row].bytes; });
  for (int32_t row = 0; row < n; ++row) staging.FillRow(row, items[row]);
}

// Row `row` of `work` holds request `r`: its index list (form, K, values) and its q.
void ExpectRow(const BatchWork& work, int row, const v1::DecodeRequest& r, int hq) {
  const DecodeBatch& d = work.decode;
  const v1::Tensor& indices = r.indices();
  const bool per_head = indices.shape_size() == 2;
  EXPECT_EQ(d.topk[row], indices.shape(per_head ? 1 : 0)) << "row " << row;
  EXPECT_EQ(d.indices_per_kv_head[row], per_head ? 1 : 0) << "row " << row;
  EXPECT_EQ(d.index_offset[row] % 16, 0) << "row " << row << ": list not on a 64-byte line";
  const std::string& sent = indices.data();
  EXPECT_EQ(std::memcmp(d.indices + d.index_offset[row], sent.data(), sent.size()), 0)
      << "row " << row << ": its index list";
  const std::string& q = r.q().data();
  EXPECT_EQ(std::memcmp(d.q + static_cast<int64_t>(row) * hq * kD, q.data(), q.size()), 0)
      << "row " << row << ": its q";
}

TEST(StagingBufferTest, IndexListsLieBackToBackAndMovedRowsKeepTheirs) {
  constexpr int kHq = 4, kHkv = 2, kMaxTopk = 16;
  Fixture f = Make(kHq, kHkv, kMaxTopk, 5);
  ASSERT_NE(f.staging, nullptr);
  // (lists, K): shared and per-KV-head lists, short, full and odd lengths.
  const int shapes[5][2] = {{1, 3}, {kHkv, 5}, {1, kMaxTopk}, {kHkv, kMaxTopk}, {1, 1}};
  std::mt19937 rng(11);
  std::vector<v1::DecodeRequest> requests;
  for (const auto& s : shapes) requests.push_back(RandomRequest(rng, kHq, kHkv, s[0], s[1]));
  Fill(*f.staging, requests);

  // Each list rounded up to 16 int32 slots: 3 -> 16, 10 -> 16, 16, 32, 1 -> 16, so the
  // lists span 96 slots (a row stride of Hkv * max_topk would span 4 * 32 + 1 = 129).
  const int64_t expected_at[5] = {0, 16, 32, 48, 80};
  BatchWork work;
  f.staging->Describe(5, &work);
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(work.decode.index_offset[r], expected_at[r]) << "row " << r;
    ExpectRow(work, r, requests[r], kHq);
  }

  // Rows 1 and 3 dropped (the executor compacts): rows 2 and 4 move down, their lists
  // stay where they are.
  f.staging->MoveRow(1, 2);
  f.staging->MoveRow(2, 4);
  f.staging->Describe(3, &work);
  const int kept[3] = {0, 2, 4};
  for (int row = 0; row < 3; ++row) {
    EXPECT_EQ(work.decode.index_offset[row], expected_at[kept[row]]) << "row " << row;
    ExpectRow(work, row, requests[kept[row]], kHq);
  }
}

// A full batch of the longest lists, where Hkv * max_topk (3 * 13 = 39) is not a whole
// number of 16-slot lines: every list fits and keeps its values (an overlap or a list
// past the end of the array would show here, and under ASan).
TEST(StagingBufferTest, AFullBatchOfTheLongestListsFits) {
  constexpr int kHq = 6, kHkv = 3, kMaxTopk = 13, kBatch = 7;
  Fixture f = Make(kHq, kHkv, kMaxTopk, kBatch);
  ASSERT_NE(f.staging, nullptr);
  std::mt19937 rng(12);
  std::vector<v1::DecodeRequest> requests;
  for (int r = 0; r < kBatch; ++r)
    requests.push_back(RandomRequest(rng, kHq, kHkv, kHkv, kMaxTopk));
  Fill(*f.staging, requests);
  BatchWork work;
  f.staging->Describe(kBatch, &work);
  for (int r = 0; r < kBatch; ++r) {
    EXPECT_EQ(work.decode.index_offset[r], 48 * r) << "row " << r;  // 39 rounded up to 48
    ExpectRow(work, r, requests[r], kHq);
  }
}

// The executor writes a batch's page tables row after row and grows the table when the
// next row does not fit: the rows already written must keep their page ids (a table
// that lost them sent earlier rows to whatever pages the new memory named).
TEST(StagingBufferTest, GrowingThePageTableKeepsTheRowsWritten) {
  Fixture f = Make(4, 2, 16, 2);
  ASSERT_NE(f.staging, nullptr);
  StagingBuffer& staging = *f.staging;
  ASSERT_TRUE(staging.ReservePageTable(1).ok());
  std::mt19937 rng(13);
  std::vector<int32_t> written;
  int64_t size = 0;
  // Rows of growing length until the table has been reallocated several times.
  int reallocations = 0;
  for (int64_t row_pages = 50; row_pages <= 800; row_pages *= 2) {
    const int32_t* before = staging.page_table();
    ASSERT_TRUE(staging.ReservePageTable(size + row_pages).ok());
    if (staging.page_table() != before) ++reallocations;
    for (int64_t j = 0; j < row_pages; ++j) {
      const auto page = static_cast<int32_t>(rng() % 100000);
      staging.page_table()[size + j] = page;
      written.push_back(page);
    }
    size += row_pages;
  }
  ASSERT_GE(reallocations, 2) << "the test must make the table grow";
  EXPECT_EQ(std::memcmp(staging.page_table(), written.data(), written.size() * sizeof(int32_t)), 0);
}

}  // namespace
}  // namespace sds::server
