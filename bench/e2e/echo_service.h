// An echo DecodeService: answers every call with a response of the real size and
// computes nothing. The ceiling of what gRPC alone costs for these message sizes.
// With work_us > 0 it also spends that much CPU per decode request (BusyWork): the
// ceiling of a server whose only cost beyond gRPC's is that computing.
#pragma once

#include <atomic>
#include <string>

#include "bench/e2e/busy_work.h"
#include "sparse_decode/v1/decode.grpc.pb.h"

namespace sds::bench {

namespace v1 = ::sparse_decode::v1;

class EchoService final : public v1::DecodeService::CallbackService {
 public:
  explicit EchoService(v1::ModelInfo info, double work_us = 0);

  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx,
                                         const v1::GetModelInfoRequest* req,
                                         v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* ctx,
                                           const v1::CreateSequenceRequest* req,
                                           v1::CreateSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* AppendKV(grpc::CallbackServerContext* ctx,
                                     const v1::AppendKVRequest* req,
                                     v1::AppendKVResponse* resp) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* ctx, const v1::DecodeRequest* req,
                                   v1::DecodeResponse* resp) override;
  grpc::ServerUnaryReactor* DecodeBatch(grpc::CallbackServerContext* ctx,
                                        const v1::DecodeBatchRequest* req,
                                        v1::DecodeBatchResponse* resp) override;
  grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* DecodeStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx,
                                         const v1::ForkSequenceRequest* req,
                                         v1::ForkSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* ctx,
                                            const v1::ReleaseSequenceRequest* req,
                                            v1::ReleaseSequenceResponse* resp) override;
  // The answer a real server gives a packed layer batch: a code per item, out (and lse)
  // inline only where the request has no region ref for it; no region is read.
  grpc::ServerUnaryReactor* DecodeLayer(grpc::CallbackServerContext* ctx,
                                        const v1::DecodeLayerRequest* req,
                                        v1::DecodeLayerResponse* resp) override;

  // Fills `resp` as a real server would answer `req` (same sizes), batch of `batch_size`,
  // after the request's work_us of CPU.
  void Answer(const v1::DecodeRequest& req, int32_t batch_size, uint64_t batch_id,
              v1::DecodeResponse* resp) const;
  uint64_t NextBatchId() { return next_batch_id_.fetch_add(1) + 1; }

 private:
  v1::ModelInfo info_;
  std::string zero_out_;  // [Hq, D] bf16 zeros
  std::string zero_lse_;  // [Hq] fp32 zeros
  std::atomic<uint64_t> next_batch_id_{0};
  BusyWork work_;  // per decode request
};

}  // namespace sds::bench
