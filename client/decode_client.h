// C++ client for the Sparse Decode Server (proto/sparse_decode/v1/decode.proto).
//
// A thin, model-runner-friendly wrapper: plain vectors of bf16 bits / int32 in,
// absl::StatusOr out, a deadline on every call, optional tenant and bearer metadata.
// Thread-safe: one DecodeClient may be shared by many threads (gRPC channels are).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "sparse_decode/v1/decode.grpc.pb.h"

namespace sds::client {

namespace v1 = ::sparse_decode::v1;

struct ClientOptions {
  // Deadline of every call that does not pass its own.
  std::chrono::milliseconds timeout{5000};
  std::string tenant_id;     // sent as "x-tenant-id" when not empty
  std::string bearer_token;  // sent as "authorization: Bearer <token>" when not empty
  // Connect(): open a TCP connection of this channel's own instead of sharing one
  // with other channels to the same address (load generators want several).
  bool dedicated_connection = false;
  // Connect(): HTTP/2 keepalive pings every `keepalive_time` (0: off, gRPC's default), so
  // a peer that vanished without a reset (host down, partition) fails the channel's calls,
  // streams without a deadline included, after `keepalive_timeout` instead of never.
  // Servers answer pings more often than every 5 minutes with GOAWAY "too_many_pings"
  // unless data flows (gRPC's ping policy), so leave it off for channels that idle with
  // streams open.
  std::chrono::milliseconds keepalive_time{0};
  std::chrono::milliseconds keepalive_timeout{10000};
};

// Per-call overrides.
struct CallOptions {
  std::optional<std::chrono::milliseconds> timeout;
  bool wait_for_ready = false;
};

// The tensor shapes a client needs to label its requests.
struct Shape {
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
};

struct DecodeInput {
  std::string sequence_id;
  int32_t layer = 0;
  int64_t position = 0;
  std::vector<uint16_t> q;           // [Hq, D] bf16 bits
  std::vector<uint16_t> k;           // [Hkv, D] bf16 bits, the new token's
  std::vector<uint16_t> v;           // [Hkv, D] bf16 bits
  std::vector<uint16_t> gate;        // [Hq, D] bf16 bits
  std::vector<int32_t> indices;      // [K] or [Hkv, K]; -1 = skip
  bool per_kv_head_indices = false;  // true: indices is [Hkv, K]
  bool return_lse = false;
  uint64_t request_id = 0;  // 0: the client picks one (streams) or leaves it 0
};

struct BatchStats {
  uint64_t batch_id = 0;
  int32_t batch_size = 0;
  int64_t queue_us = 0;
  int64_t compute_us = 0;
};

struct DecodeOutput {
  uint64_t request_id = 0;
  std::vector<uint16_t> out;  // [Hq, D] bf16 bits
  std::vector<float> lse;     // [Hq], empty unless return_lse
  BatchStats batch;
};

// Builds the wire request (exposed for callers that pre-build requests).
absl::StatusOr<v1::DecodeRequest> BuildDecodeRequest(const DecodeInput& in, const Shape& shape);
// Decodes a wire response; a non-zero error_code becomes the returned status.
absl::StatusOr<DecodeOutput> ParseDecodeResponse(const v1::DecodeResponse& resp);
absl::Status FromGrpc(const grpc::Status& s);

class DecodeStream;

class DecodeClient {
 public:
  DecodeClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options = {});
  // Insecure channel to host:port (loopback or in-cluster traffic).
  static std::unique_ptr<DecodeClient> Connect(const std::string& address,
                                               ClientOptions options = {});

  absl::StatusOr<v1::ModelInfo> GetModelInfo(const CallOptions& call = {});
  // The shape used to label tensors: fetched once with GetModelInfo unless set.
  absl::StatusOr<Shape> GetShape();
  void SetShape(const Shape& shape);

  // Returns the pages reserved.
  absl::StatusOr<int64_t> CreateSequence(const std::string& sequence_id, int64_t reserve_tokens = 0,
                                         const CallOptions& call = {});
  // k, v: [n, Hkv, D] bf16 bits. Returns the layer's length after the append.
  absl::StatusOr<int64_t> AppendKV(const std::string& sequence_id, int32_t layer,
                                   int64_t start_position, const std::vector<uint16_t>& k,
                                   const std::vector<uint16_t>& v, const CallOptions& call = {});
  absl::Status ForkSequence(const std::string& sequence_id, const std::string& new_sequence_id,
                            const CallOptions& call = {});
  absl::StatusOr<int64_t> ReleaseSequence(const std::string& sequence_id,
                                          const CallOptions& call = {});

  absl::StatusOr<DecodeOutput> Decode(const DecodeInput& in, const CallOptions& call = {});
  // The outer status is the RPC's; each inner one is its request's (same order).
  absl::StatusOr<std::vector<absl::StatusOr<DecodeOutput>>> DecodeBatch(
      const std::vector<DecodeInput>& inputs, const CallOptions& call = {});

  // Opens a DecodeStream; `call.timeout` bounds the whole stream's life.
  absl::StatusOr<std::unique_ptr<DecodeStream>> OpenStream(const CallOptions& call = {});

  v1::DecodeService::Stub* stub() { return stub_.get(); }
  // Applies deadline and metadata to a fresh context (for callers using stub()).
  void PrepareContext(grpc::ClientContext* ctx, const CallOptions& call) const;
  // A context for a DecodeStream, which lives across many calls: no deadline unless
  // `call.timeout` asks for one (a Send blocked in Write is ended by a cancel, or by
  // keepalive when the peer is gone).
  std::unique_ptr<grpc::ClientContext> StreamContext(const CallOptions& call = {}) const;

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
  ClientOptions options_;
  std::mutex shape_mu_;
  std::optional<Shape> shape_;
};

// One open DecodeStream: send many requests, receive each result by request_id.
// Send is thread-safe; a background reader files responses by request_id.
class DecodeStream {
 public:
  ~DecodeStream();
  DecodeStream(const DecodeStream&) = delete;
  DecodeStream& operator=(const DecodeStream&) = delete;

  // Sends one request; returns its request_id (assigned when in.request_id == 0).
  absl::StatusOr<uint64_t> Send(const DecodeInput& in);
  // Waits for the response to `request_id`, at most `timeout`.
  absl::StatusOr<DecodeOutput> Receive(uint64_t request_id, std::chrono::milliseconds timeout);
  // Send then Receive.
  absl::StatusOr<DecodeOutput> Call(const DecodeInput& in, std::chrono::milliseconds timeout);
  // Half-closes, drains and returns the stream's final status.
  absl::Status Close();
  // Cancels the stream; callable from any thread, while another is in Send or Receive.
  // A Send blocked in Write has no deadline of its own (the stream's window is full when
  // the server does not read); this is how another thread makes it return.
  void Cancel();
  // OK while the stream is open and healthy.
  absl::Status status();

 private:
  friend class DecodeClient;
  DecodeStream(Shape shape, std::unique_ptr<grpc::ClientContext> ctx,
               v1::DecodeService::Stub* stub);
  void ReadLoop();

  Shape shape_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw_;
  std::mutex write_mu_;
  bool writes_done_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, v1::DecodeResponse> ready_;
  bool reader_done_ = false;
  absl::Status final_status_;
  uint64_t next_id_ = 1;
  std::atomic<bool> cancelled_{false};
  std::thread reader_;
};

}  // namespace sds::client
