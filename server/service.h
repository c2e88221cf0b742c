// The gRPC DecodeService on the callback API. Handlers validate, resolve the tenant and
// hand work to the batcher; nothing here blocks a gRPC thread on the backend.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "absl/status/statusor.h"
#include "server/backend.h"
#include "server/batcher.h"
#include "server/credentials.h"
#include "server/decode_submit.h"
#include "server/metrics.h"
#include "server/model_shape.h"
#include "server/pending_writes.h"
#include "server/response_wire.h"
#include "server/shm_region.h"
#include "server/task_pool.h"
#include "sparse_decode/v1/decode.grpc.pb.h"

namespace sds::server {

class DecodeStreamReactor;

// The generated callback service with every method taken raw (as gRPC ByteBuffers);
// the wire format is unchanged. Decode, DecodeBatch and DecodeStream are parsed by
// wire_decode.h, so that tensor bytes go from the received slices straight into the
// staging buffer. The other methods are parsed whole by protobuf in the handler
// (raw_call.h, TypedCall): a malformed message is then answered INVALID_ARGUMENT and
// counted, where gRPC's typed methods answer it INTERNAL before any handler runs.
namespace generated = sparse_decode::v1;
using DecodeServiceBase = generated::DecodeService::WithRawCallbackMethod_GetModelInfo<
    generated::DecodeService::WithRawCallbackMethod_CreateSequence<
        generated::DecodeService::WithRawCallbackMethod_AppendKV<
            generated::DecodeService::WithRawCallbackMethod_Decode<
                generated::DecodeService::WithRawCallbackMethod_DecodeBatch<
                    generated::DecodeService::WithRawCallbackMethod_DecodeStream<
                        generated::DecodeService::WithRawCallbackMethod_ForkSequence<
                            generated::DecodeService::WithRawCallbackMethod_ReleaseSequence<
                                generated::DecodeService::WithRawCallbackMethod_RegisterRegion<
                                    generated::DecodeService::WithRawCallbackMethod_UnregisterRegion<
                                        generated::DecodeService::WithRawCallbackMethod_ListRegions<
                                            generated::DecodeService::
                                                WithRawCallbackMethod_DecodeLayer<
                                                    generated::DecodeService::
                                                        WithRawCallbackMethod_DecodeLayerStream<
                                                            generated::DecodeService::
                                                                Service>>>>>>>>>>>>>;

struct ServiceConfig {
  ModelShape model;
  CallerAuth auth;                           // who a caller is (credentials.h)
  int32_t max_unanswered_per_stream = 4096;  // DecodeStream (--max_unanswered_per_stream)
  int32_t answer_threads = 0;                // DecodeStream answer pool (task_pool.h); 0 = none
  int32_t max_decode_batch_items =
      1024;  // requests per DecodeBatch call (--max_decode_batch_items)
  // --allow_client_shm: RegisterRegion and region refs in DecodeLayer (shm_region.h).
  bool allow_client_shm = false;
  RegionLimits region_limits;
  // Static fields of GetModelInfo; total_pages/free_pages are filled per call.
  sparse_decode::v1::ModelInfo info;
};

class DecodeServiceImpl final : public DecodeServiceBase {
 public:
  DecodeServiceImpl(ServiceConfig config, Backend* backend, Batcher* batcher, Metrics* metrics);

  // New RPCs fail UNAVAILABLE ("server is draining"); open streams stop reading and
  // finish once their requests are answered.
  void StartDraining();
  int64_t active_streams() const { return active_streams_.load(); }

  // Every method is raw: `request` holds the serialized request message of the method
  // (GetModelInfoRequest, ...), `response` receives the serialized response.
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AppendKV(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // Raw: `request` is a serialized DecodeRequest, `response` receives a DecodeResponse.
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  // Raw: a DecodeBatchRequest in, a DecodeBatchResponse out.
  grpc::ServerUnaryReactor* DecodeBatch(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  // Raw: DecodeRequest messages in, DecodeResponse messages out (stream_reactor.h).
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  // The shared-memory data plane (region_service.cc).
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const grpc::ByteBuffer* request,
                                             grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  // Raw: a DecodeLayerRequest in, a DecodeLayerResponse out (layer_call.h).
  grpc::ServerUnaryReactor* DecodeLayer(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  // Raw: DecodeLayerRequest messages in, DecodeLayerResponse messages out.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeLayerStream(
      grpc::CallbackServerContext* context) override;

  // Regions registered now, for /metrics.
  RegionTotals region_totals() const { return regions_.Totals(); }

 private:
  // Draining check, then authentication; returns the tenant.
  absl::StatusOr<std::string> Admit(const grpc::CallbackServerContext& context) const;
  // Maps the memory a RegisterRegion names (a system region here, a CUDA one through
  // the backend).
  absl::StatusOr<std::shared_ptr<Region>> MapRegion(
      const sparse_decode::v1::RegisterRegionRequest& request);
  // Plans one DecodeLayer message (layer_call.h) and queues its items; `finish` runs
  // once: with the call's error (nothing queued), or OK when every item is answered in
  // `response`. `request` and `response` must live until then.
  void RunLayerCall(const std::string& tenant, const sparse_decode::v1::DecodeLayerRequest* request,
                    sparse_decode::v1::DecodeLayerResponse* response, Clock::time_point deadline,
                    const std::function<bool()>& cancelled,
                    const std::function<void(const absl::Status&)>& finish);

  const ServiceConfig config_;
  Backend* const backend_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  PendingWrites pending_;        // before admission_, which points to it
  const AnswerEncoder encoder_;  // the bytes path's answers (response_wire.h)
  RegionRegistry regions_;
  const DecodeAdmission admission_;
  // Writes DecodeStream answers of multi-request batches (null with answer_threads 0).
  // Outlives every stream: the service is destroyed after the gRPC server shut down.
  std::unique_ptr<TaskPool> answer_pool_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> active_streams_{0};
  std::recursive_mutex streams_mu_;  // recursive: a finished stream may unregister inline
  std::unordered_set<DecodeStreamReactor*> streams_;
};

}  // namespace sds::server
