// The framing shared by the fuzz targets: a header that the fuzzer mutates along with
// the message, so that it also chooses where the received message is cut into slices
// (gRPC hands a handler a ByteBuffer of several slices, and a tensor or a varint may
// straddle two of them).
//
//   byte 0       selector: which message type or method (each target reads it its way)
//   byte 1       low 3 bits: number of cuts n (0-7); high 5 bits: a small parameter
//   2n bytes     cut offsets, little-endian uint16 each, taken modulo (body size + 1)
//   the rest     the body: the serialized message
#pragma once

#include <grpc/grpc.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sds::fuzz {

struct FramedInput {
  uint8_t selector = 0;
  uint8_t param = 0;         // 0-31
  std::vector<size_t> cuts;  // sorted offsets into body, each in [0, body.size()]
  std::string body;
};

// False when the input is shorter than its header.
inline bool ParseFramed(const uint8_t* data, size_t size, FramedInput* out) {
  if (size < 2) return false;
  out->selector = data[0];
  out->param = static_cast<uint8_t>(data[1] >> 3);
  const size_t n = data[1] & 7;
  if (size < 2 + 2 * n) return false;
  const uint8_t* body = data + 2 + 2 * n;
  out->body.assign(reinterpret_cast<const char*>(body), size - 2 - 2 * n);
  out->cuts.clear();
  for (size_t i = 0; i < n; ++i) {
    const size_t raw = data[2 + 2 * i] | (size_t{data[3 + 2 * i]} << 8);
    out->cuts.push_back(raw % (out->body.size() + 1));
  }
  std::sort(out->cuts.begin(), out->cuts.end());
  return true;
}

// The inverse, for the corpus generator: a header of `cuts` (at most 7) and `param`.
inline std::string Frame(uint8_t selector, uint8_t param, const std::vector<uint16_t>& cuts,
                         const std::string& body) {
  std::string out;
  out.push_back(static_cast<char>(selector));
  out.push_back(static_cast<char>((param & 31) << 3 | (cuts.size() & 7)));
  for (size_t i = 0; i < cuts.size() && i < 7; ++i) {
    out.push_back(static_cast<char>(cuts[i] & 0xff));
    out.push_back(static_cast<char>(cuts[i] >> 8));
  }
  return out + body;
}

// The pieces of `body` between consecutive cuts (empty pieces included: gRPC may hand
// out empty slices too).
inline std::vector<std::string> Pieces(const FramedInput& in) {
  std::vector<std::string> pieces;
  size_t at = 0;
  for (size_t cut : in.cuts) {
    pieces.push_back(in.body.substr(at, cut - at));
    at = cut;
  }
  pieces.push_back(in.body.substr(at));
  return pieces;
}

// A ByteBuffer of one slice per piece. Each slice copies its piece into its own
// allocation, so that a read past a slice's end is a heap overflow that ASan sees
// (small slices are inlined in the slice object itself: gRPC does the same).
inline grpc::ByteBuffer SlicedBuffer(const FramedInput& in) {
  static const bool initialised = (grpc_init(), true);  // slices need the library
  (void)initialised;
  std::vector<grpc::Slice> slices;
  for (const std::string& piece : Pieces(in)) slices.emplace_back(piece.data(), piece.size());
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace sds::fuzz
