// StagingBuffer (server/staging.h): the rows a batch's requests are copied into and how
// the backend sees them. The index lists of a batch must lie back to back (a backend
// copies the span from the first list to the end of the last one to the device), each
// at the slot its caller gave it, and a moved row must keep its list.
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
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

constexpr int kHq = 4, kHkv = 2, kD = 64, kMaxTopk = 16;

template <typename T>
void SetTensor(v1::Tensor* t, v1::DType dtype, const std::vector<int64_t>& shape,
               const std::vector<T>& values) {
  t->set_dtype(dtype);
  for (int64_t dim : shape) t->add_shape(dim);
  t->set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
}

// A request with random bf16 tensors and `lists` index lists of `k` random positions
// (some -1); lists == kHkv sends the [Hkv, K] form.
v1::DecodeRequest RandomRequest(std::mt19937& rng, int lists, int k) {
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
  SetTensor(request.mutable_q(), v1::BF16, {kHq, kD}, bf16(kHq * kD));
  SetTensor(request.mutable_gate(), v1::BF16, {kHq, kD}, bf16(kHq * kD));
  SetTensor(request.mutable_k(), v1::BF16, {kHkv, kD}, bf16(kHkv * kD));
  SetTensor(request.mutable_v(), v1::BF16, {kHkv, kD}, bf16(kHkv * kD));
  if (lists == 1) {
    SetTensor(request.mutable_indices(), v1::INT32, {k}, indices);
  } else {
    SetTensor(request.mutable_indices(), v1::INT32, {lists, k}, indices);
  }
  return request;
}

TEST(StagingBufferTest, IndexListsLieBackToBackAndMovedRowsKeepTheirs) {
  const BackendConfig config = {.cache = {.num_layers = 1,
                                          .num_kv_heads = kHkv,
                                          .head_dim = kD,
                                          .page_size = 16,
                                          .num_pages = 16,
                                          .scale_mode = ScaleMode::kPerTensor,
                                          .layer_k_scales = {},
                                          .layer_v_scales = {}},
                                .num_q_heads = kHq,
                                .max_batch_size = 5,
                                .max_topk = kMaxTopk,
                                .cpu_threads = 1};
  auto backend = CreateCpuBackend(config);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const ModelShape model{1, kHq, kHkv, kD, kMaxTopk};
  auto staging = StagingBuffer::Create(backend->get(), model, config.max_batch_size);
  ASSERT_TRUE(staging.ok()) << staging.status();

  // (lists, K): shared and per-KV-head lists, short, full and odd lengths.
  const int shapes[5][2] = {{1, 3}, {kHkv, 5}, {1, kMaxTopk}, {kHkv, kMaxTopk}, {1, 1}};
  // Each list rounded up to 16 int32 slots: 3 -> 16, 10 -> 16, 16, 32, 1 -> 16.
  const int64_t expected_at[5] = {0, 16, 32, 48, 80};
  std::mt19937 rng(11);
  std::vector<v1::DecodeRequest> requests;
  for (const auto& s : shapes) requests.push_back(RandomRequest(rng, s[0], s[1]));
  int64_t at = 0;
  for (int r = 0; r < 5; ++r) {
    const DecodeTensorBytes bytes = DecodeTensorBytes::Of(requests[r]);
    ASSERT_EQ(at, expected_at[r]) << "row " << r;
    (*staging)->FillRow(r, requests[r], bytes, at);
    at += StagingBuffer::IndexSlots(bytes);
  }
  EXPECT_EQ(at, 96);  // a row stride of Hkv * max_topk would span 4 * 32 + 16 = 144

  auto check = [&](const BatchWork& work, int row, int r) {
    const DecodeBatch& d = work.decode;
    const int lists = shapes[r][0], k = shapes[r][1];
    EXPECT_EQ(d.index_offset[row], expected_at[r]) << "row " << row;
    EXPECT_EQ(d.topk[row], k) << "row " << row;
    EXPECT_EQ(d.indices_per_kv_head[row], lists == kHkv ? 1 : 0) << "row " << row;
    const std::string& sent = requests[r].indices().data();
    EXPECT_EQ(std::memcmp(d.indices + d.index_offset[row], sent.data(), sent.size()), 0)
        << "row " << row << ": its index list";
    const std::string& q = requests[r].q().data();
    EXPECT_EQ(std::memcmp(d.q + static_cast<int64_t>(row) * kHq * kD, q.data(), q.size()), 0)
        << "row " << row << ": its q";
  };
  BatchWork work;
  (*staging)->Describe(5, &work);
  for (int r = 0; r < 5; ++r) check(work, r, r);

  // Rows 1 and 3 dropped (the executor compacts): rows 2 and 4 move down, their lists
  // stay where they are.
  (*staging)->MoveRow(1, 2);
  (*staging)->MoveRow(2, 4);
  (*staging)->Describe(3, &work);
  check(work, 0, 0);
  check(work, 1, 2);
  check(work, 2, 4);
}

}  // namespace
}  // namespace sds::server
