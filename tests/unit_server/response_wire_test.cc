// The answer encoder (server/response_wire.h) must write exactly the bytes protobuf
// writes for the same message: DecodeResponse with out and lse taken from borrowed
// views, DecodeResponse from its own fields, and DecodeBatchResponse assembled from
// per-item slices, on random messages (zeros, which proto3 omits, large and negative
// varints, empty and present tensors and strings).
#include "server/response_wire.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

// Mostly small values, sometimes 0 (omitted) or far out (long and negative varints).
int64_t RandomInt(std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0:
      return 0;
    case 1:
      return static_cast<int64_t>(rng());  // any 64-bit pattern, negatives included
    default:
      return static_cast<int64_t>(rng() % 300);
  }
}

// Empty half the time; `text`: printable ASCII (a proto3 string must be UTF-8).
std::string RandomBytes(std::mt19937_64& rng, size_t max_len, bool text = false) {
  std::string s(rng() % 2 ? rng() % (max_len + 1) : 0, '\0');
  for (char& c : s) c = static_cast<char>(text ? ' ' + rng() % 95 : rng());
  return s;
}

void RandomTensor(std::mt19937_64& rng, v1::Tensor* t) {
  t->set_dtype(static_cast<v1::DType>(rng() % 6));
  const int dims = static_cast<int>(rng() % 4);
  for (int i = 0; i < dims; ++i) t->add_shape(RandomInt(rng));
  t->set_data(RandomBytes(rng, 700));  // up to two-byte lengths
}

v1::DecodeResponse RandomResponse(std::mt19937_64& rng) {
  v1::DecodeResponse r;
  r.set_request_id(static_cast<uint64_t>(RandomInt(rng)));
  if (rng() % 4 != 0) RandomTensor(rng, r.mutable_out());
  if (rng() % 2 != 0) RandomTensor(rng, r.mutable_lse());
  if (rng() % 4 != 0) {
    v1::BatchInfo* b = r.mutable_batch();
    b->set_batch_id(static_cast<uint64_t>(RandomInt(rng)));
    b->set_batch_size(static_cast<int32_t>(RandomInt(rng)));
    b->set_queue_us(RandomInt(rng));
    b->set_compute_us(RandomInt(rng));
  }
  r.set_error_code(static_cast<int32_t>(RandomInt(rng)));
  r.set_error_message(RandomBytes(rng, 200, /*text=*/true));
  return r;
}

TensorView ViewOf(const v1::Tensor& t) {
  return TensorView{t.dtype(), absl::MakeConstSpan(t.shape().data(), t.shape_size()), t.data()};
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string s;
  for (const grpc::Slice& slice : slices) {
    s.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return s;
}

std::string Encoded(const v1::DecodeResponse& fields, const TensorView* out, const TensorView* lse,
                    bool batch_item) {
  EncodedResponse encoded;
  encoded.batch_item = batch_item;
  EncodeDecodeResponse(fields, out, lse, &encoded);
  return std::string(reinterpret_cast<const char*>(encoded.bytes.begin()), encoded.bytes.size());
}

// A field added to the messages must be added to the encoder (and to this test).
TEST(ResponseWire, KnowsEveryField) {
  EXPECT_EQ(v1::DecodeResponse::descriptor()->field_count(), 6);
  EXPECT_EQ(v1::Tensor::descriptor()->field_count(), 3);
  EXPECT_EQ(v1::DecodeBatchResponse::descriptor()->field_count(), 1);
}

TEST(ResponseWire, SameBytesAsProtobuf) {
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seed = rng();
  SCOPED_TRACE(seed);
  rng.seed(seed);
  for (int iter = 0; iter < 3000; ++iter) {
    const v1::DecodeResponse full = RandomResponse(rng);
    const std::string want = full.SerializeAsString();
    // From the message's own fields.
    EXPECT_EQ(Encoded(full, nullptr, nullptr, false), want);
    EXPECT_EQ(DecodeResponseSize(full, nullptr, nullptr), want.size());
    // out and lse from views, as the executor writes them from staging.
    v1::DecodeResponse fields = full;
    fields.clear_out();
    fields.clear_lse();
    const TensorView out = ViewOf(full.out()), lse = ViewOf(full.lse());
    const std::string from_views =
        Encoded(fields, full.has_out() ? &out : nullptr, full.has_lse() ? &lse : nullptr, false);
    ASSERT_EQ(from_views, want) << "iteration " << iter;
    std::string written(DecodeResponseSize(full, nullptr, nullptr), '\0');
    uint8_t* end =
        WriteDecodeResponse(full, nullptr, nullptr, reinterpret_cast<uint8_t*>(written.data()));
    EXPECT_EQ(end, reinterpret_cast<uint8_t*>(written.data()) + written.size());
    EXPECT_EQ(written, want);
  }
}

TEST(ResponseWire, BatchReplyIsTheBatchMessage) {
  std::mt19937_64 rng(std::random_device{}());
  const uint64_t seed = rng();
  SCOPED_TRACE(seed);
  rng.seed(seed);
  for (int iter = 0; iter < 300; ++iter) {
    const int n = static_cast<int>(rng() % 9);
    v1::DecodeBatchResponse want;
    v1::DecodeBatchResponse typed;  // what the service keeps: no tensors for encoded items
    std::vector<EncodedResponse> encoded(n);
    for (int i = 0; i < n; ++i) {
      v1::DecodeResponse full = RandomResponse(rng);
      const bool encoded_item = rng() % 3 != 0;
      // An item the service answers itself carries an error.
      if (!encoded_item && full.error_code() == 0) full.set_error_code(14);
      *want.add_responses() = full;
      v1::DecodeResponse* slot = typed.add_responses();
      encoded[i].batch_item = true;
      if (encoded_item) {  // answered by the executor: encoded from views
        *slot = full;
        slot->clear_out();
        slot->clear_lse();
        const TensorView out = ViewOf(full.out()), lse = ViewOf(full.lse());
        EncodeDecodeResponse(*slot, full.has_out() ? &out : nullptr,
                             full.has_lse() ? &lse : nullptr, &encoded[i]);
      } else {  // answered with an error by the service: the typed slot
        *slot = full;
      }
    }
    absl::StatusOr<grpc::ByteBuffer> reply = DecodeBatchReply(typed, &encoded);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const std::string bytes = Flatten(*reply);
    ASSERT_EQ(bytes, want.SerializeAsString()) << "iteration " << iter << ", " << n << " items";
    v1::DecodeBatchResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    EXPECT_EQ(parsed.responses_size(), n);
  }
}

// Tensors of 16 KB (three-byte lengths: 64 heads x 128 dims of bf16) and 2 MiB (four).
TEST(ResponseWire, LargeTensors) {
  std::mt19937_64 rng(11);
  for (size_t bytes : {size_t{16383}, size_t{16384}, size_t{2} << 20}) {
    v1::DecodeResponse full;
    full.set_request_id(7);
    v1::Tensor* out = full.mutable_out();
    out->set_dtype(v1::BF16);
    out->add_shape(static_cast<int64_t>(bytes / 2));
    std::string data(bytes, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    out->set_data(data);
    full.mutable_batch()->set_batch_size(3);
    v1::DecodeResponse fields = full;
    fields.clear_out();
    const TensorView view = ViewOf(full.out());
    EXPECT_EQ(Encoded(fields, &view, nullptr, true),
              [&] {
                v1::DecodeBatchResponse batch;
                *batch.add_responses() = full;
                return batch.SerializeAsString();
              }())
        << bytes << " bytes";
  }
}

// An item the executor answered OK must have been encoded: a typed slot without an
// error (so without its tensors) is a bug, reported instead of sent.
TEST(ResponseWire, BatchItemWithoutAnAnswerIsAnError) {
  v1::DecodeBatchResponse typed;
  typed.add_responses()->set_request_id(1);
  std::vector<EncodedResponse> encoded(1);
  encoded[0].batch_item = true;
  absl::StatusOr<grpc::ByteBuffer> reply = DecodeBatchReply(typed, &encoded);
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kInternal);
  typed.mutable_responses(0)->set_error_code(5);
  EXPECT_TRUE(DecodeBatchReply(typed, &encoded).ok());
}

// A single decode's reply is its encoded answer; none is a bug, reported instead of sent.
TEST(ResponseWire, SingleReplyIsTheEncodedAnswer) {
  EncodedResponse encoded;
  EXPECT_EQ(DecodeReply(encoded).status().code(), absl::StatusCode::kInternal);
  v1::DecodeResponse fields;
  fields.set_request_id(9);
  fields.mutable_batch()->set_batch_size(1);
  EncodeDecodeResponse(fields, nullptr, nullptr, &encoded);
  absl::StatusOr<grpc::ByteBuffer> reply = DecodeReply(encoded);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(Flatten(*reply), fields.SerializeAsString());
}

}  // namespace
}  // namespace sds::server
