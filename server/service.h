// The gRPC DecodeService on the callback API. Handlers validate, resolve the tenant and
// hand work to the batcher; nothing here blocks a gRPC thread on the backend.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_set>

#include "absl/status/statusor.h"
#include "server/arena_allocator.h"
#include "server/backend.h"
#include "server/batcher.h"
#include "server/decode_submit.h"
#include "server/metrics.h"
#include "server/model_shape.h"
#include "server/pending_writes.h"
#include "sparse_decode/v1/decode.grpc.pb.h"

namespace sds::server {

class DecodeStreamReactor;

struct ServiceConfig {
  ModelShape model;
  std::string auth_token;
  // Static fields of GetModelInfo; total_pages/free_pages are filled per call.
  sparse_decode::v1::ModelInfo info;
};

class DecodeServiceImpl final : public sparse_decode::v1::DecodeService::CallbackService {
 public:
  DecodeServiceImpl(ServiceConfig config, Backend* backend, Batcher* batcher, Metrics* metrics);

  // New RPCs fail UNAVAILABLE ("server is draining"); open streams stop reading and
  // finish once their requests are answered.
  void StartDraining();
  int64_t active_streams() const { return active_streams_.load(); }

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const sparse_decode::v1::GetModelInfoRequest* request,
                                         sparse_decode::v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* CreateSequence(
      grpc::CallbackServerContext* context, const sparse_decode::v1::CreateSequenceRequest* request,
      sparse_decode::v1::CreateSequenceResponse* response) override;
  grpc::ServerUnaryReactor* AppendKV(grpc::CallbackServerContext* context,
                                     const sparse_decode::v1::AppendKVRequest* request,
                                     sparse_decode::v1::AppendKVResponse* response) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* context,
                                   const sparse_decode::v1::DecodeRequest* request,
                                   sparse_decode::v1::DecodeResponse* response) override;
  grpc::ServerUnaryReactor* DecodeBatch(grpc::CallbackServerContext* context,
                                        const sparse_decode::v1::DecodeBatchRequest* request,
                                        sparse_decode::v1::DecodeBatchResponse* response) override;
  grpc::ServerBidiReactor<sparse_decode::v1::DecodeRequest, sparse_decode::v1::DecodeResponse>*
  DecodeStream(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ForkSequence(
      grpc::CallbackServerContext* context, const sparse_decode::v1::ForkSequenceRequest* request,
      sparse_decode::v1::ForkSequenceResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(
      grpc::CallbackServerContext* context,
      const sparse_decode::v1::ReleaseSequenceRequest* request,
      sparse_decode::v1::ReleaseSequenceResponse* response) override;

 private:
  // Draining check, then authentication; returns the tenant.
  absl::StatusOr<std::string> Admit(const grpc::CallbackServerContext& context) const;

  const ServiceConfig config_;
  Backend* const backend_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  PendingWrites pending_;  // before admission_, which points to it
  const DecodeAdmission admission_;
  // Per-call arenas for Decode and DecodeBatch (set on the handlers in the constructor).
  ArenaMessageAllocator<sparse_decode::v1::DecodeRequest, sparse_decode::v1::DecodeResponse>
      decode_allocator_;
  ArenaMessageAllocator<sparse_decode::v1::DecodeBatchRequest,
                        sparse_decode::v1::DecodeBatchResponse>
      batch_allocator_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> active_streams_{0};
  std::recursive_mutex streams_mu_;  // recursive: a finished stream may unregister inline
  std::unordered_set<DecodeStreamReactor*> streams_;
};

}  // namespace sds::server
