#include "bench/e2e/echo_service.h"

namespace sds::bench {
namespace {

grpc::ServerUnaryReactor* Ok(grpc::CallbackServerContext* ctx) {
  auto* r = ctx->DefaultReactor();
  r->Finish(grpc::Status::OK);
  return r;
}

// Reads requests and writes one response each, in order, one write in flight.
class EchoStream final : public grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse> {
 public:
  explicit EchoStream(EchoService* service) : service_(service) { StartRead(&req_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    resp_.Clear();
    service_->Answer(req_, 1, service_->NextBatchId(), &resp_);
    StartWrite(&resp_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
      return;
    }
    StartRead(&req_);
  }
  void OnDone() override { delete this; }

 private:
  EchoService* service_;
  v1::DecodeRequest req_;
  v1::DecodeResponse resp_;
};

}  // namespace

EchoService::EchoService(v1::ModelInfo info, double work_us)
    : info_(std::move(info)), work_(work_us) {
  zero_out_.assign(size_t{2} * info_.num_q_heads() * info_.head_dim(), '\0');
  zero_lse_.assign(size_t{4} * info_.num_q_heads(), '\0');
}

void EchoService::Answer(const v1::DecodeRequest& req, int32_t batch_size, uint64_t batch_id,
                         v1::DecodeResponse* resp) const {
  work_.Run();
  resp->set_request_id(req.request_id());
  auto* out = resp->mutable_out();
  out->set_dtype(v1::BF16);
  out->add_shape(info_.num_q_heads());
  out->add_shape(info_.head_dim());
  out->set_data(zero_out_);
  if (req.return_lse()) {
    auto* lse = resp->mutable_lse();
    lse->set_dtype(v1::FP32);
    lse->add_shape(info_.num_q_heads());
    lse->set_data(zero_lse_);
  }
  auto* b = resp->mutable_batch();
  b->set_batch_id(batch_id);
  b->set_batch_size(batch_size);
}

grpc::ServerUnaryReactor* EchoService::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                    const v1::GetModelInfoRequest*,
                                                    v1::ModelInfo* resp) {
  *resp = info_;
  return Ok(ctx);
}

grpc::ServerUnaryReactor* EchoService::CreateSequence(grpc::CallbackServerContext* ctx,
                                                      const v1::CreateSequenceRequest*,
                                                      v1::CreateSequenceResponse*) {
  return Ok(ctx);
}

grpc::ServerUnaryReactor* EchoService::AppendKV(grpc::CallbackServerContext* ctx,
                                                const v1::AppendKVRequest* req,
                                                v1::AppendKVResponse* resp) {
  const int64_t n = req->k().shape_size() > 0 ? req->k().shape(0) : 0;
  resp->set_length(req->start_position() + n);
  return Ok(ctx);
}

grpc::ServerUnaryReactor* EchoService::Decode(grpc::CallbackServerContext* ctx,
                                              const v1::DecodeRequest* req,
                                              v1::DecodeResponse* resp) {
  Answer(*req, 1, NextBatchId(), resp);
  return Ok(ctx);
}

grpc::ServerUnaryReactor* EchoService::DecodeBatch(grpc::CallbackServerContext* ctx,
                                                   const v1::DecodeBatchRequest* req,
                                                   v1::DecodeBatchResponse* resp) {
  const uint64_t id = NextBatchId();
  for (const auto& r : req->requests()) Answer(r, req->requests_size(), id, resp->add_responses());
  return Ok(ctx);
}

grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* EchoService::DecodeStream(
    grpc::CallbackServerContext*) {
  return new EchoStream(this);
}

grpc::ServerUnaryReactor* EchoService::DecodeLayer(grpc::CallbackServerContext* ctx,
                                                   const v1::DecodeLayerRequest* req,
                                                   v1::DecodeLayerResponse* resp) {
  const int b = req->sequence_ids_size();
  resp->set_request_id(req->request_id());
  for (int i = 0; i < b; ++i) {
    resp->add_error_codes(0);
    resp->add_error_messages("");
  }
  if (!req->out().has_ref()) {
    v1::Tensor* out = resp->mutable_out();
    out->set_dtype(v1::BF16);
    for (int64_t dim : {int64_t{b}, int64_t{info_.num_q_heads()}, int64_t{info_.head_dim()}})
      out->add_shape(dim);
    out->mutable_data()->assign(static_cast<size_t>(b) * zero_out_.size(), '\0');
  }
  if (req->return_lse() && !req->lse().has_ref()) {
    v1::Tensor* lse = resp->mutable_lse();
    lse->set_dtype(v1::FP32);
    lse->add_shape(b);
    lse->add_shape(info_.num_q_heads());
    lse->mutable_data()->assign(static_cast<size_t>(b) * zero_lse_.size(), '\0');
  }
  v1::BatchInfo* batch = resp->mutable_batch();
  batch->set_batch_id(NextBatchId());
  batch->set_batch_size(b);
  return Ok(ctx);
}

grpc::ServerUnaryReactor* EchoService::ForkSequence(grpc::CallbackServerContext* ctx,
                                                    const v1::ForkSequenceRequest*,
                                                    v1::ForkSequenceResponse*) {
  return Ok(ctx);
}

grpc::ServerUnaryReactor* EchoService::ReleaseSequence(grpc::CallbackServerContext* ctx,
                                                       const v1::ReleaseSequenceRequest*,
                                                       v1::ReleaseSequenceResponse*) {
  return Ok(ctx);
}

}  // namespace sds::bench
