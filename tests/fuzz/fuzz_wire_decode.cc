// libFuzzer target: WireMessage (server/wire_decode.h) over a received message cut into
// slices at fuzzer-chosen bytes. Properties, besides ASan and UBSan staying quiet:
// - it accepts exactly what protobuf's generated parser accepts;
// - an accepted message has protobuf's fields (unknown fields aside) and each tensor's
//   views hold protobuf's `data` bytes;
// - DecodeBatch stops at max_items (the header's parameter) before parsing further.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "server/tensor_bytes.h"
#include "server/wire_decode.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

namespace v1 = sparse_decode::v1;
using sds::server::DecodeTensorBytes;
using sds::server::TensorBytes;

std::string Concat(const TensorBytes& bytes) {
  std::string out(bytes.size(), '\0');
  bytes.CopyTo(out.data());
  return out;
}

// `wire` (fields without data, views in `bytes`) against `typed` (protobuf's parse).
void ExpectSame(const v1::DecodeRequest& wire, const DecodeTensorBytes& bytes,
                v1::DecodeRequest typed) {
  SDS_FUZZ_CHECK(Concat(bytes.q) == typed.q().data(), "q data differs");
  SDS_FUZZ_CHECK(Concat(bytes.k) == typed.k().data(), "k data differs");
  SDS_FUZZ_CHECK(Concat(bytes.v) == typed.v().data(), "v data differs");
  SDS_FUZZ_CHECK(Concat(bytes.gate) == typed.gate().data(), "gate data differs");
  SDS_FUZZ_CHECK(Concat(bytes.indices) == typed.indices().data(), "indices data differs");
  // The wire parser creates a tensor field it saw even when empty, as protobuf does;
  // compare with the data left out (of the fields present: mutable_q() would create q)
  // and unknown fields dropped.
  if (typed.has_q()) typed.mutable_q()->clear_data();
  if (typed.has_k()) typed.mutable_k()->clear_data();
  if (typed.has_v()) typed.mutable_v()->clear_data();
  if (typed.has_gate()) typed.mutable_gate()->clear_data();
  if (typed.has_indices()) typed.mutable_indices()->clear_data();
  typed.DiscardUnknownFields();
  v1::DecodeRequest fields = wire;
  fields.DiscardUnknownFields();
  SDS_FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(fields, typed),
                 "fields differ:\nwire: %s\nprotobuf: %s", fields.ShortDebugString().c_str(),
                 typed.ShortDebugString().c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sds::fuzz::FramedInput in;
  if (!sds::fuzz::ParseFramed(data, size, &in)) return -1;  // not added to the corpus
  const grpc::ByteBuffer buffer = sds::fuzz::SlicedBuffer(in);
  sds::server::WireMessage message;
  SDS_FUZZ_CHECK(message.Take(buffer).ok(), "Take failed");
  SDS_FUZZ_CHECK(message.size() == in.body.size(), "size %zu of %zu", message.size(),
                 in.body.size());

  if ((in.selector & 1) == 0) {
    v1::DecodeRequest wire;
    DecodeTensorBytes bytes;
    const absl::Status parsed = message.ParseDecodeRequest(&wire, &bytes);
    v1::DecodeRequest typed;
    const bool typed_ok = typed.ParseFromString(in.body);
    SDS_FUZZ_CHECK(parsed.ok() == typed_ok, "wire: %s, protobuf: %s", parsed.ToString().c_str(),
                   typed_ok ? "OK" : "rejected");
    if (parsed.ok()) ExpectSame(wire, bytes, typed);
    SDS_FUZZ_CHECK(parsed.ok() || parsed.code() == absl::StatusCode::kInvalidArgument, "%s",
                   parsed.ToString().c_str());
    return 0;
  }

  // A parameter of 31 is the server's default limit; 0-30 are small limits, so that
  // the fuzzer meets the item limit on short inputs.
  const int max_items = in.param == 31 ? 1024 : in.param;
  v1::DecodeBatchRequest wire;
  std::vector<DecodeTensorBytes> bytes;
  const absl::Status parsed = message.ParseDecodeBatch(&wire, &bytes, max_items);
  SDS_FUZZ_CHECK(parsed.ok() || parsed.code() == absl::StatusCode::kInvalidArgument, "%s",
                 parsed.ToString().c_str());
  v1::DecodeBatchRequest typed;
  const bool typed_ok = typed.ParseFromString(in.body);
  if (parsed.ok()) {
    SDS_FUZZ_CHECK(typed_ok, "wire accepted a batch that protobuf rejects");
    SDS_FUZZ_CHECK(wire.requests_size() <= max_items, "%d items over the limit %d",
                   wire.requests_size(), max_items);
    SDS_FUZZ_CHECK(wire.requests_size() == typed.requests_size() &&
                       bytes.size() == static_cast<size_t>(wire.requests_size()),
                   "%d items, protobuf %d, views %zu", wire.requests_size(), typed.requests_size(),
                   bytes.size());
    for (int i = 0; i < wire.requests_size(); ++i) {
      ExpectSame(wire.requests(i), bytes[i], typed.requests(i));
    }
  } else {
    // Rejected: protobuf rejects it too, or it holds more than max_items items (the
    // wire parser stops there, before reading what follows).
    SDS_FUZZ_CHECK(!typed_ok || typed.requests_size() > max_items,
                   "wire rejected a batch of %d items that protobuf accepts: %s",
                   typed.requests_size(), parsed.ToString().c_str());
  }
  return 0;
}
