// Unary calls of DecodeClient.
#include "client/decode_client.h"

#include "absl/strings/str_cat.h"

namespace sds::client {

DecodeClient::DecodeClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)),
      stub_(v1::DecodeService::NewStub(channel_)),
      options_(std::move(options)) {}

std::unique_ptr<DecodeClient> DecodeClient::Connect(const std::string& address,
                                                    ClientOptions options) {
  grpc::ChannelArguments args;
  // Tensors for large batches exceed the 4 MiB default.
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (options.dedicated_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (options.keepalive_time.count() > 0) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(options.keepalive_time.count()));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(options.keepalive_timeout.count()));
  }
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  return std::make_unique<DecodeClient>(std::move(channel), std::move(options));
}

void DecodeClient::PrepareContext(grpc::ClientContext* ctx, const CallOptions& call) const {
  const auto timeout = call.timeout.value_or(options_.timeout);
  if (timeout.count() > 0) ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  ctx->set_wait_for_ready(call.wait_for_ready);
  if (!options_.tenant_id.empty()) ctx->AddMetadata("x-tenant-id", options_.tenant_id);
  if (!options_.bearer_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
}

std::unique_ptr<grpc::ClientContext> DecodeClient::StreamContext(const CallOptions& call) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  CallOptions c = call;
  if (!c.timeout) c.timeout = std::chrono::milliseconds(0);
  PrepareContext(ctx.get(), c);
  return ctx;
}

absl::StatusOr<v1::ModelInfo> DecodeClient::GetModelInfo(const CallOptions& call) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, call);
  v1::ModelInfo info;
  absl::Status st = FromGrpc(stub_->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info));
  if (!st.ok()) return st;
  return info;
}

absl::StatusOr<Shape> DecodeClient::GetShape() {
  {
    std::lock_guard<std::mutex> lock(shape_mu_);
    if (shape_) return *shape_;
  }
  auto info = GetModelInfo();
  if (!info.ok()) return info.status();
  Shape s{info->num_q_heads(), info->num_kv_heads(), info->head_dim()};
  SetShape(s);
  return s;
}

void DecodeClient::SetShape(const Shape& shape) {
  std::lock_guard<std::mutex> lock(shape_mu_);
  shape_ = shape;
}

absl::StatusOr<int64_t> DecodeClient::CreateSequence(const std::string& sequence_id,
                                                     int64_t reserve_tokens,
                                                     const CallOptions& call) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, call);
  v1::CreateSequenceRequest req;
  req.set_sequence_id(sequence_id);
  req.set_reserve_tokens(reserve_tokens);
  v1::CreateSequenceResponse resp;
  absl::Status st = FromGrpc(stub_->CreateSequence(&ctx, req, &resp));
  if (!st.ok()) return st;
  return resp.reserved_pages();
}

absl::StatusOr<int64_t> DecodeClient::AppendKV(const std::string& sequence_id, int32_t layer,
                                               int64_t start_position,
                                               const std::vector<uint16_t>& k,
                                               const std::vector<uint16_t>& v,
                                               const CallOptions& call) {
  auto shape = GetShape();
  if (!shape.ok()) return shape.status();
  const int64_t row = int64_t{shape->num_kv_heads} * shape->head_dim;
  if (row == 0 || k.size() != v.size() || k.size() % row != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AppendKV: k has ", k.size(), " and v ", v.size(),
                     " elements; both must be the same multiple of Hkv*D=", row));
  }
  v1::AppendKVRequest req;
  req.set_sequence_id(sequence_id);
  req.set_layer(layer);
  req.set_start_position(start_position);
  const int64_t n = static_cast<int64_t>(k.size()) / row;
  for (auto [t, src] : {std::pair{req.mutable_k(), &k}, std::pair{req.mutable_v(), &v}}) {
    t->set_dtype(v1::BF16);
    t->add_shape(n);
    t->add_shape(shape->num_kv_heads);
    t->add_shape(shape->head_dim);
    t->set_data(reinterpret_cast<const char*>(src->data()), src->size() * 2);
  }
  grpc::ClientContext ctx;
  PrepareContext(&ctx, call);
  v1::AppendKVResponse resp;
  absl::Status st = FromGrpc(stub_->AppendKV(&ctx, req, &resp));
  if (!st.ok()) return st;
  return resp.length();
}

absl::Status DecodeClient::ForkSequence(const std::string& sequence_id,
                                        const std::string& new_sequence_id,
                                        const CallOptions& call) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, call);
  v1::ForkSequenceRequest req;
  req.set_sequence_id(sequence_id);
  req.set_new_sequence_id(new_sequence_id);
  v1::ForkSequenceResponse resp;
  return FromGrpc(stub_->ForkSequence(&ctx, req, &resp));
}

absl::StatusOr<int64_t> DecodeClient::ReleaseSequence(const std::string& sequence_id,
                                                      const CallOptions& call) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx, call);
  v1::ReleaseSequenceRequest req;
  req.set_sequence_id(sequence_id);
  v1::ReleaseSequenceResponse resp;
  absl::Status st = FromGrpc(stub_->ReleaseSequence(&ctx, req, &resp));
  if (!st.ok()) return st;
  return resp.freed_pages();
}

absl::StatusOr<DecodeOutput> DecodeClient::Decode(const DecodeInput& in, const CallOptions& call) {
  auto shape = GetShape();
  if (!shape.ok()) return shape.status();
  auto req = BuildDecodeRequest(in, *shape);
  if (!req.ok()) return req.status();
  grpc::ClientContext ctx;
  PrepareContext(&ctx, call);
  v1::DecodeResponse resp;
  absl::Status st = FromGrpc(stub_->Decode(&ctx, *req, &resp));
  if (!st.ok()) return st;
  return ParseDecodeResponse(resp);
}

absl::StatusOr<std::vector<absl::StatusOr<DecodeOutput>>> DecodeClient::DecodeBatch(
    const std::vector<DecodeInput>& inputs, const CallOptions& call) {
  auto shape = GetShape();
  if (!shape.ok()) return shape.status();
  v1::DecodeBatchRequest batch;
  for (const DecodeInput& in : inputs) {
    auto req = BuildDecodeRequest(in, *shape);
    if (!req.ok()) return req.status();
    *batch.add_requests() = *std::move(req);
  }
  grpc::ClientContext ctx;
  PrepareContext(&ctx, call);
  v1::DecodeBatchResponse resp;
  absl::Status st = FromGrpc(stub_->DecodeBatch(&ctx, batch, &resp));
  if (!st.ok()) return st;
  if (resp.responses_size() != batch.requests_size()) {
    return absl::InternalError(absl::StrCat("DecodeBatch answered ", resp.responses_size(),
                                            " responses to ", batch.requests_size(), " requests"));
  }
  std::vector<absl::StatusOr<DecodeOutput>> outs;
  outs.reserve(resp.responses_size());
  for (const auto& r : resp.responses()) outs.push_back(ParseDecodeResponse(r));
  return outs;
}

absl::StatusOr<std::unique_ptr<DecodeStream>> DecodeClient::OpenStream(const CallOptions& call) {
  auto shape = GetShape();
  if (!shape.ok()) return shape.status();
  // Each Receive has its own timeout.
  return std::unique_ptr<DecodeStream>(new DecodeStream(*shape, StreamContext(call), stub_.get()));
}

}  // namespace sds::client
