// WireMessage (server/wire_decode.h): DecodeRequest and DecodeBatchRequest parsed from
// received slices, split at random bytes, must agree with protobuf's own parser: the
// same fields, each tensor's data as views over the slices, the same accept / reject
// decision on truncated and corrupted messages, and the same validation result
// (ValidateDecode over the views vs over the typed message).
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/tensor_bytes.h"
#include "server/validate.h"
#include "server/wire_decode.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

const ModelShape kModel = [] {
  ModelShape m;
  m.num_layers = 3;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  m.max_topk = 64;
  return m;
}();

// ValidateDecode's verdict on a request whose data is at `bytes` (the item thrown away).
absl::Status ValidateWire(const v1::DecodeRequest& request, const DecodeTensorBytes& bytes) {
  DecodeItem item;
  return ValidateDecode(request, bytes, kModel, &item);
}

std::string RandomBytes(size_t n, std::mt19937& rng) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Finite bf16 values (exponent below 255), as a request would carry.
std::string FiniteBf16(size_t count, std::mt19937& rng) {
  std::string s(count * 2, '\0');
  for (size_t i = 0; i < count; ++i) {
    const uint16_t bits = static_cast<uint16_t>((rng() % 255) << 7 | (rng() & 0x807F));
    std::memcpy(&s[2 * i], &bits, 2);
  }
  return s;
}

void SetTensor(v1::Tensor* t, v1::DType dtype, const std::vector<int64_t>& shape,
               std::string data) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(std::move(data));
}

// A request that passes ValidateDecode at kModel, unless `rng` decides to break it (a
// NaN, an index out of range, a wrong size): both parsers must then give the same error.
v1::DecodeRequest RandomRequest(std::mt19937& rng) {
  v1::DecodeRequest r;
  r.set_sequence_id("seq-" + std::to_string(rng() % 1000));
  r.set_layer(static_cast<int32_t>(rng() % 3));
  r.set_position(static_cast<int64_t>(rng() % 200));
  r.set_return_lse(rng() % 2 == 0);
  r.set_request_id(rng() % 3 == 0 ? 0 : (uint64_t{rng()} << 32 | rng()));
  const size_t q = kModel.num_q_heads * kModel.head_dim;
  const size_t kv = kModel.num_kv_heads * kModel.head_dim;
  SetTensor(r.mutable_q(), v1::BF16, {kModel.num_q_heads, kModel.head_dim}, FiniteBf16(q, rng));
  SetTensor(r.mutable_k(), v1::BF16, {kModel.num_kv_heads, kModel.head_dim}, FiniteBf16(kv, rng));
  SetTensor(r.mutable_v(), v1::BF16, {kModel.num_kv_heads, kModel.head_dim}, FiniteBf16(kv, rng));
  SetTensor(r.mutable_gate(), v1::BF16, {kModel.num_q_heads, kModel.head_dim}, FiniteBf16(q, rng));
  const bool per_head = rng() % 2 == 0;
  const int64_t k = 1 + static_cast<int64_t>(rng() % 40);
  const int64_t count = per_head ? k * kModel.num_kv_heads : k;
  std::vector<int32_t> idx(count);
  for (int32_t& i : idx) i = rng() % 5 == 0 ? -1 : static_cast<int32_t>(rng() % (r.position() + 1));
  SetTensor(r.mutable_indices(), v1::INT32,
            per_head ? std::vector<int64_t>{kModel.num_kv_heads, k} : std::vector<int64_t>{k},
            std::string(reinterpret_cast<const char*>(idx.data()), idx.size() * 4));
  switch (rng() % 8) {  // one defect in some requests
    case 0: {
      std::string* data = r.mutable_gate()->mutable_data();
      const size_t at = 2 * (rng() % q);
      (*data)[at] = static_cast<char>(rng() % 2 ? 0x80 : 0xC0);  // Inf or NaN
      (*data)[at + 1] = static_cast<char>(rng() % 2 ? 0x7F : 0xFF);
      break;
    }
    case 1: {
      int32_t bad = static_cast<int32_t>(r.position() + 1 + rng() % 5);
      std::memcpy(&(*r.mutable_indices()->mutable_data())[4 * (rng() % count)], &bad, 4);
      break;
    }
    case 2:
      r.mutable_k()->mutable_data()->pop_back();
      break;
    default:
      break;
  }
  return r;
}

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Fields protobuf keeps as unknown and the wire parser skips: an unknown varint, an
// unknown length-delimited field, and the known field `layer` (2) with the
// length-delimited wire type.
std::string UnknownFields(std::mt19937& rng) {
  std::string s;
  AppendVarint(99 << 3 | 0, &s);
  AppendVarint(rng(), &s);
  AppendVarint(100 << 3 | 2, &s);
  const std::string junk = RandomBytes(rng() % 20, rng);
  AppendVarint(junk.size(), &s);
  s += junk;
  if (rng() % 2) {
    AppendVarint(2 << 3 | 2, &s);
    AppendVarint(3, &s);
    s += "abc";
  }
  return s;
}

// The encoding of a batch of `requests`, each with unknown fields mixed in, and a
// second `q` occurrence in some (protobuf merges it: shape appended, data replaced).
std::string EncodeBatch(const std::vector<v1::DecodeRequest>& requests, std::mt19937& rng) {
  std::string batch;
  for (const v1::DecodeRequest& r : requests) {
    std::string item = UnknownFields(rng) + r.SerializeAsString();
    if (rng() % 4 == 0) {
      v1::Tensor extra;
      extra.add_shape(1);
      extra.set_data(RandomBytes(rng() % 9, rng));
      AppendVarint(v1::DecodeRequest::kQFieldNumber << 3 | 2, &item);
      const std::string t = extra.SerializeAsString();
      AppendVarint(t.size(), &item);
      item += t;
    }
    AppendVarint(v1::DecodeBatchRequest::kRequestsFieldNumber << 3 | 2, &batch);
    AppendVarint(item.size(), &batch);
    batch += item;
  }
  return batch;
}

// `bytes` as a received message: slices cut at random points (1-byte and empty slices
// included; slices under 24 bytes are inlined by gRPC).
grpc::ByteBuffer Sliced(const std::string& bytes, std::mt19937& rng) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t roll = rng() % 10;
    const size_t len = std::min(bytes.size() - at, roll == 0   ? size_t{1}
                                                   : roll == 1 ? size_t{0}
                                                   : roll < 5  ? rng() % 24
                                                               : rng() % 700);
    slices.emplace_back(bytes.data() + at, len);
    at += len;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// For a failure message (`protoc --decode_raw` reads the bytes back).
std::string Hex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string h;
  for (unsigned char c : bytes) {
    h += kDigits[c >> 4];
    h += kDigits[c & 15];
  }
  return h;
}

std::string Copy(const TensorBytes& t) {
  std::string s(t.size(), '\0');
  t.CopyTo(s.data());
  return s;
}

// The wire parse of `encoded` must match protobuf's typed parse: same success, and on
// success the same fields (data cleared, unknown fields dropped), the data as views, and
// the same ValidateDecode result per request.
void ExpectSameAsProtobuf(const std::string& encoded, std::mt19937& rng, const std::string& what) {
  SCOPED_TRACE(what);
  v1::DecodeBatchRequest typed;
  const bool typed_ok = typed.ParseFromString(encoded);
  WireMessage wire;
  ASSERT_TRUE(wire.Take(Sliced(encoded, rng)).ok());
  ASSERT_EQ(wire.size(), encoded.size());
  v1::DecodeBatchRequest parsed;
  std::vector<DecodeTensorBytes> bytes;
  const absl::Status s = wire.ParseDecodeBatch(&parsed, &bytes, 1 << 20);
  ASSERT_EQ(s.ok(), typed_ok) << s << "; the message: " << Hex(encoded);
  if (!s.ok()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return;
  }
  ASSERT_EQ(parsed.requests_size(), typed.requests_size());
  ASSERT_EQ(bytes.size(), static_cast<size_t>(typed.requests_size()));
  for (int i = 0; i < typed.requests_size(); ++i) {
    const v1::DecodeRequest& want = typed.requests(i);
    const DecodeTensorBytes& b = bytes[i];
    EXPECT_EQ(Copy(b.q), want.q().data()) << i;
    EXPECT_EQ(Copy(b.k), want.k().data()) << i;
    EXPECT_EQ(Copy(b.v), want.v().data()) << i;
    EXPECT_EQ(Copy(b.gate), want.gate().data()) << i;
    EXPECT_EQ(Copy(b.indices), want.indices().data()) << i;
    const absl::Status typed_valid = ValidateDecode(want, kModel);
    const absl::Status wire_valid = ValidateWire(parsed.requests(i), b);
    EXPECT_EQ(wire_valid, typed_valid) << i;
    v1::DecodeRequest stripped = want;
    stripped.DiscardUnknownFields();
    // (mutable_x() would add a tensor that the message may not have.)
    if (stripped.has_q()) stripped.mutable_q()->clear_data();
    if (stripped.has_k()) stripped.mutable_k()->clear_data();
    if (stripped.has_v()) stripped.mutable_v()->clear_data();
    if (stripped.has_gate()) stripped.mutable_gate()->clear_data();
    if (stripped.has_indices()) stripped.mutable_indices()->clear_data();
    // Deterministic serialization of equal messages is equal.
    EXPECT_EQ(parsed.requests(i).SerializeAsString(), stripped.SerializeAsString()) << i;
  }
}

TEST(WireDecode, RandomBatchesMatchProtobuf) {
  std::mt19937 rng(std::random_device{}());
  const uint32_t seed = rng();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  rng.seed(seed);
  int invalid = 0, pieces = 0;
  for (int round = 0; round < 200; ++round) {
    std::vector<v1::DecodeRequest> requests(1 + rng() % 5);
    for (v1::DecodeRequest& r : requests) r = RandomRequest(rng);
    const std::string encoded = EncodeBatch(requests, rng);
    ExpectSameAsProtobuf(encoded, rng, "round " + std::to_string(round));
    // Count what the rounds covered: requests that fail validation, split tensors.
    WireMessage wire;
    ASSERT_TRUE(wire.Take(Sliced(encoded, rng)).ok());
    v1::DecodeBatchRequest parsed;
    std::vector<DecodeTensorBytes> bytes;
    ASSERT_TRUE(wire.ParseDecodeBatch(&parsed, &bytes, 1 << 20).ok());
    for (size_t i = 0; i < bytes.size(); ++i) {
      invalid += !ValidateWire(parsed.requests(i), bytes[i]).ok();
      pieces += bytes[i].q.num_pieces() > 1;
    }
  }
  EXPECT_GT(invalid, 50);  // the defects were drawn and found
  EXPECT_GT(pieces, 50);   // tensors split over slices were parsed
}

TEST(WireDecode, EveryTruncationAgreesWithProtobuf) {
  std::mt19937 rng(7);
  std::vector<v1::DecodeRequest> requests = {RandomRequest(rng), RandomRequest(rng)};
  const std::string encoded = EncodeBatch(requests, rng);
  for (size_t n = 0; n <= encoded.size(); ++n) {
    ExpectSameAsProtobuf(encoded.substr(0, n), rng, "prefix " + std::to_string(n));
  }
}

TEST(WireDecode, CorruptedBytesAgreeWithProtobuf) {
  std::mt19937 rng(std::random_device{}());
  const uint32_t seed = rng();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  rng.seed(seed);
  for (int round = 0; round < 400; ++round) {
    std::vector<v1::DecodeRequest> requests = {RandomRequest(rng)};
    std::string encoded = EncodeBatch(requests, rng);
    // Corrupt the framing, where the decisions are: bytes near the start of the message
    // and of a tensor, and anywhere.
    for (int hits = 1 + rng() % 3; hits > 0; --hits) {
      const size_t at =
          rng() % 2 ? rng() % std::min<size_t>(encoded.size(), 64) : rng() % encoded.size();
      encoded[at] = static_cast<char>(rng());
    }
    ExpectSameAsProtobuf(encoded, rng, "round " + std::to_string(round));
  }
}

TEST(WireDecode, SingleRequestAndEmptyMessage) {
  std::mt19937 rng(11);
  const v1::DecodeRequest want = RandomRequest(rng);
  WireMessage wire;
  ASSERT_TRUE(wire.Take(Sliced(want.SerializeAsString(), rng)).ok());
  v1::DecodeRequest parsed;
  DecodeTensorBytes bytes;
  ASSERT_TRUE(wire.ParseDecodeRequest(&parsed, &bytes).ok());
  EXPECT_EQ(parsed.request_id(), want.request_id());
  EXPECT_EQ(Copy(bytes.gate), want.gate().data());
  EXPECT_EQ(Copy(bytes.indices), want.indices().data());
  EXPECT_EQ(ValidateWire(parsed, bytes), ValidateDecode(want, kModel));

  WireMessage empty;  // a message of zero bytes is a valid, empty DecodeBatchRequest
  ASSERT_TRUE(empty.Take(grpc::ByteBuffer()).ok());
  v1::DecodeBatchRequest batch;
  std::vector<DecodeTensorBytes> none;
  EXPECT_TRUE(empty.ParseDecodeBatch(&batch, &none, 1).ok());
  EXPECT_EQ(batch.requests_size(), 0);
}

// An element split between two pieces is visited once, assembled, at its index.
TEST(TensorBytes, ElementRunsAcrossPieces) {
  const std::string data = "abcdefghijklmnopqrstuvwx";  // 6 elements of 4 bytes
  for (size_t cut1 = 0; cut1 <= data.size(); ++cut1) {
    for (size_t cut2 = cut1; cut2 <= data.size(); ++cut2) {
      TensorBytes t;
      t.Append(data.data(), cut1);
      t.Append(data.data() + cut1, cut2 - cut1);
      t.Append(data.data() + cut2, data.size() - cut2);
      std::string seen;
      int64_t next = 0;
      t.ForEachElementRun(4, [&](const char* run, int64_t count, int64_t first) {
        EXPECT_EQ(first, next);
        next += count;
        seen.append(run, count * 4);
      });
      EXPECT_EQ(seen, data) << cut1 << " " << cut2;
      EXPECT_EQ(Copy(t), data);
    }
  }
}

// B1: a DecodeBatch of empty items costs 2 bytes each on the wire; the parser stops at
// the cap before building the item past it, whatever the message holds after it.
TEST(WireDecode, BatchPastItsItemCapIsRefusedBeforeItsItemsAreBuilt) {
  std::string encoded;
  for (int i = 0; i < 4000; ++i) encoded += std::string("\x0a\x00", 2);
  WireMessage wire;
  std::mt19937 rng(1);
  ASSERT_TRUE(wire.Take(Sliced(encoded, rng)).ok());
  v1::DecodeBatchRequest parsed;
  std::vector<DecodeTensorBytes> bytes;
  const absl::Status refused = wire.ParseDecodeBatch(&parsed, &bytes, 1000);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("more than 1000 requests"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("--max_decode_batch_items"), std::string::npos) << refused;
  EXPECT_EQ(parsed.requests_size(), 0);
  EXPECT_TRUE(bytes.empty());
  // At the cap it parses.
  parsed.Clear();
  ASSERT_TRUE(wire.ParseDecodeBatch(&parsed, &bytes, 4000).ok());
  EXPECT_EQ(parsed.requests_size(), 4000);
}

}  // namespace
}  // namespace sds::server
