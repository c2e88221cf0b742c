#include "server/wire_decode.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;
using google::protobuf::io::CodedInputStream;
using WFL = google::protobuf::internal::WireFormatLite;

// The slices of one message as a protobuf input stream. Next() hands out pointers into
// the slices themselves, so a pointer taken from CodedInputStream stays valid as long
// as the slices do (an inlined small slice keeps its bytes inside its grpc::Slice
// object, which the WireMessage's vector holds in place).
class SliceInputStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit SliceInputStream(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  bool Next(const void** data, int* size) override {
    if (backed_up_ > 0) {
      const grpc::Slice& s = slices_[next_ - 1];
      *data = s.begin() + (s.size() - backed_up_);
      *size = backed_up_;
      byte_count_ += backed_up_;
      backed_up_ = 0;
      return true;
    }
    while (next_ < slices_.size()) {
      const grpc::Slice& s = slices_[next_++];
      if (s.size() == 0) continue;
      *data = s.begin();
      *size = static_cast<int>(s.size());
      byte_count_ += static_cast<int64_t>(s.size());
      return true;
    }
    return false;
  }
  void BackUp(int count) override {
    backed_up_ = count;
    byte_count_ -= count;
  }
  bool Skip(int count) override {
    const void* data;
    int size;
    while (count > 0) {
      if (!Next(&data, &size)) return false;
      if (size > count) {
        BackUp(size - count);
        return true;
      }
      count -= size;
    }
    return true;
  }
  int64_t ByteCount() const override { return byte_count_; }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t next_ = 0;    // the slice that Next() hands out after the backed-up bytes
  int backed_up_ = 0;  // unread bytes at the end of slice next_ - 1
  int64_t byte_count_ = 0;
};

constexpr uint32_t Tag(int field, WFL::WireType type) { return WFL::MakeTag(field, type); }
constexpr WFL::WireType kVarint = WFL::WIRETYPE_VARINT;
constexpr WFL::WireType kLen = WFL::WIRETYPE_LENGTH_DELIMITED;

// The next tag, or 0 at the end of the message body (the enclosing limit). Sets
// *malformed where protobuf's generated parser rejects the message: a 0 tag, a tag
// varint longer than 5 bytes (CodedInputStream::ReadTag would silently truncate it) or
// field number 0.
uint32_t NextTag(CodedInputStream* in, bool* malformed) {
  const int before = in->CurrentPosition();
  const uint32_t tag = in->ReadTag();
  if (tag == 0) {
    *malformed = !in->ConsumedEntireMessage();
    return 0;
  }
  if (in->CurrentPosition() - before > 5 || WFL::GetTagFieldNumber(tag) == 0) {
    *malformed = true;
    return 0;
  }
  return tag;
}

// Reads a length prefix and runs `body` inside that limit; true when `body` succeeded
// and ended exactly at the limit (a tag of 0 or a short message fails). Every call is
// inside a limit (ParseWhole pushes the message's size).
template <typename Body>
bool ReadDelimited(CodedInputStream* in, Body&& body) {
  uint32_t length;
  if (!in->ReadVarint32(&length) || length > INT_MAX) return false;
  // PushLimit keeps the enclosing limit where it is nearer: a length running past the
  // enclosing message would otherwise end quietly at its end.
  if (static_cast<int>(length) > in->BytesUntilLimit()) return false;
  const CodedInputStream::Limit limit = in->PushLimit(static_cast<int>(length));
  const bool ok = body() && in->BytesUntilLimit() == 0;
  in->PopLimit(limit);
  return ok;
}

// Views the next `length` bytes (already bounded by the message's limit) into `bytes`.
bool TakeBytes(CodedInputStream* in, uint32_t length, TensorBytes* bytes) {
  bytes->Clear();
  while (length > 0) {
    const void* data;
    int size;
    if (!in->GetDirectBufferPointer(&data, &size)) return false;
    const int take = static_cast<int>(std::min<uint32_t>(length, static_cast<uint32_t>(size)));
    bytes->Append(static_cast<const char*>(data), static_cast<size_t>(take));
    if (!in->Skip(take)) return false;
    length -= static_cast<uint32_t>(take);
  }
  return true;
}

// The body of one Tensor occurrence, merged into `meta` as protobuf merges a repeated
// singular message field: dtype and data replaced when present, shape appended.
bool ReadTensorBody(CodedInputStream* in, v1::Tensor* meta, TensorBytes* bytes) {
  bool malformed = false;
  while (const uint32_t tag = NextTag(in, &malformed)) {
    switch (tag) {
      case Tag(v1::Tensor::kDtypeFieldNumber, kVarint): {
        uint32_t dtype;
        if (!in->ReadVarint32(&dtype)) return false;
        meta->set_dtype(static_cast<v1::DType>(dtype));
        break;
      }
      case Tag(v1::Tensor::kShapeFieldNumber, kLen):  // packed
        if (!ReadDelimited(in, [&] {
              while (in->BytesUntilLimit() > 0) {
                uint64_t dim;
                if (!in->ReadVarint64(&dim)) return false;
                meta->add_shape(static_cast<int64_t>(dim));
              }
              return true;
            })) {
          return false;
        }
        break;
      case Tag(v1::Tensor::kShapeFieldNumber, kVarint): {  // one unpacked element
        uint64_t dim;
        if (!in->ReadVarint64(&dim)) return false;
        meta->add_shape(static_cast<int64_t>(dim));
        break;
      }
      case Tag(v1::Tensor::kDataFieldNumber, kLen): {
        uint32_t length;
        if (!in->ReadVarint32(&length) || length > INT_MAX) return false;
        if (in->BytesUntilLimit() < static_cast<int>(length)) return false;
        if (!TakeBytes(in, length, bytes)) return false;
        break;
      }
      default:
        if (!WFL::SkipField(in, tag)) return false;
    }
  }
  return !malformed;
}

// The message field and the data view of DecodeRequest's tensor field `field`.
std::pair<v1::Tensor*, TensorBytes*> TensorField(int field, v1::DecodeRequest* request,
                                                 DecodeTensorBytes* bytes) {
  switch (field) {
    case v1::DecodeRequest::kQFieldNumber:
      return {request->mutable_q(), &bytes->q};
    case v1::DecodeRequest::kKFieldNumber:
      return {request->mutable_k(), &bytes->k};
    case v1::DecodeRequest::kVFieldNumber:
      return {request->mutable_v(), &bytes->v};
    case v1::DecodeRequest::kGateFieldNumber:
      return {request->mutable_gate(), &bytes->gate};
    default:
      return {request->mutable_indices(), &bytes->indices};
  }
}

bool ReadDecodeRequestBody(CodedInputStream* in, v1::DecodeRequest* request,
                           DecodeTensorBytes* bytes) {
  bool malformed = false;
  while (const uint32_t tag = NextTag(in, &malformed)) {
    uint64_t value = 0;
    switch (tag) {
      case Tag(v1::DecodeRequest::kSequenceIdFieldNumber, kLen): {
        std::string* id = request->mutable_sequence_id();
        // proto3 strings must be UTF-8: the typed parser rejects the message otherwise.
        if (!WFL::ReadString(in, id) ||
            !WFL::VerifyUtf8String(id->data(), static_cast<int>(id->size()), WFL::PARSE,
                                   "sparse_decode.v1.DecodeRequest.sequence_id")) {
          return false;
        }
        break;
      }
      case Tag(v1::DecodeRequest::kLayerFieldNumber, kVarint):
        if (!in->ReadVarint64(&value)) return false;
        request->set_layer(static_cast<int32_t>(value));
        break;
      case Tag(v1::DecodeRequest::kPositionFieldNumber, kVarint):
        if (!in->ReadVarint64(&value)) return false;
        request->set_position(static_cast<int64_t>(value));
        break;
      case Tag(v1::DecodeRequest::kQFieldNumber, kLen):
      case Tag(v1::DecodeRequest::kKFieldNumber, kLen):
      case Tag(v1::DecodeRequest::kVFieldNumber, kLen):
      case Tag(v1::DecodeRequest::kGateFieldNumber, kLen):
      case Tag(v1::DecodeRequest::kIndicesFieldNumber, kLen): {
        // (Not a structured binding: clang cannot capture one in the lambda.)
        const auto field = TensorField(WFL::GetTagFieldNumber(tag), request, bytes);
        v1::Tensor* meta = field.first;
        TensorBytes* data = field.second;
        if (!ReadDelimited(in, [&] { return ReadTensorBody(in, meta, data); })) return false;
        break;
      }
      case Tag(v1::DecodeRequest::kReturnLseFieldNumber, kVarint):
        if (!in->ReadVarint64(&value)) return false;
        request->set_return_lse(value != 0);
        break;
      case Tag(v1::DecodeRequest::kRequestIdFieldNumber, kVarint):
        if (!in->ReadVarint64(&value)) return false;
        request->set_request_id(value);
        break;
      default:  // unknown fields (and known numbers with another wire type) are skipped
        if (!WFL::SkipField(in, tag)) return false;
    }
  }
  return !malformed;
}

// Runs `body` over the whole message as if it were length-delimited.
template <typename Body>
absl::Status ParseWhole(const std::vector<grpc::Slice>& slices, size_t size, const char* what,
                        Body&& body) {
  if (size > INT_MAX) return absl::InvalidArgumentError(absl::StrCat(what, " is over 2 GB"));
  SliceInputStream stream(slices);
  CodedInputStream in(&stream);
  const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(size));
  const bool ok = body(&in) && in.BytesUntilLimit() == 0;
  in.PopLimit(limit);
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", what, ": not a valid protobuf encoding (failed near byte ",
                     in.CurrentPosition(), " of ", size, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WireMessage::Take(const grpc::ByteBuffer& buffer) {
  slices_.clear();
  if (!buffer.Valid()) return absl::OkStatus();  // an empty message
  grpc::Status s = buffer.Dump(&slices_);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot read the received message: ", s.error_message()));
  }
  return absl::OkStatus();
}

size_t WireMessage::size() const {
  size_t total = 0;
  for (const grpc::Slice& s : slices_) total += s.size();
  return total;
}

absl::Status WireMessage::ParseDecodeRequest(v1::DecodeRequest* request,
                                             DecodeTensorBytes* bytes) const {
  return ParseWhole(slices_, size(), "DecodeRequest", [&](CodedInputStream* in) {
    return ReadDecodeRequestBody(in, request, bytes);
  });
}

absl::Status WireMessage::ParseDecodeBatch(v1::DecodeBatchRequest* batch,
                                           std::vector<DecodeTensorBytes>* bytes,
                                           int max_items) const {
  bytes->clear();
  bool too_many = false;
  absl::Status parsed =
      ParseWhole(slices_, size(), "DecodeBatchRequest", [&](CodedInputStream* in) {
        bool malformed = false;
        while (const uint32_t tag = NextTag(in, &malformed)) {
          if (tag != Tag(v1::DecodeBatchRequest::kRequestsFieldNumber, kLen)) {
            if (!WFL::SkipField(in, tag)) return false;
            continue;
          }
          if (batch->requests_size() >= max_items) {
            too_many = true;
            return false;
          }
          v1::DecodeRequest* request = batch->add_requests();
          DecodeTensorBytes* request_bytes = &bytes->emplace_back();
          if (!ReadDelimited(in,
                             [&] { return ReadDecodeRequestBody(in, request, request_bytes); })) {
            return false;
          }
        }
        return !malformed;
      });
  if (too_many) {
    batch->Clear();
    bytes->clear();
    return absl::InvalidArgumentError(
        absl::StrCat("DecodeBatchRequest holds more than ", max_items,
                     " requests (the server's --max_decode_batch_items); split it"));
  }
  return parsed;
}

}  // namespace sds::server
