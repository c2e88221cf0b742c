#include "client/loadgen/single_call_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace sds::loadgen {

absl::StatusOr<std::unique_ptr<SingleCallStream>> SingleCallStream::Open(
    client::DecodeClient* client) {
  auto shape = client->GetShape();
  if (!shape.ok()) return shape.status();
  // No deadline: a call's is the runner's canceller.
  return std::unique_ptr<SingleCallStream>(
      new SingleCallStream(*shape, client->StreamContext(), client->stub()));
}

SingleCallStream::SingleCallStream(client::Shape shape, std::unique_ptr<grpc::ClientContext> ctx,
                                   client::v1::DecodeService::Stub* stub)
    : shape_(shape), ctx_(std::move(ctx)), rw_(stub->DecodeStream(ctx_.get())) {}

SingleCallStream::~SingleCallStream() {
  if (finished_) return;
  ctx_->TryCancel();
  rw_->Finish();  // returns at once once cancelled; its status is of no use here
}

void SingleCallStream::Cancel() { ctx_->TryCancel(); }  // thread-safe in gRPC

absl::Status SingleCallStream::End(const char* what) {
  if (!finished_) {
    finished_ = true;
    const absl::Status st = client::FromGrpc(rw_->Finish());
    final_status_ =
        st.ok()
            ? absl::UnavailableError(absl::StrCat("DecodeStream ended by the server (", what, ")"))
            : st;
  }
  return final_status_;
}

absl::StatusOr<client::DecodeOutput> SingleCallStream::Call(const client::DecodeInput& in) {
  if (finished_) return final_status_;
  auto req = client::BuildDecodeRequest(in, shape_);
  if (!req.ok()) return req.status();
  const uint64_t id = in.request_id != 0 ? in.request_id : next_id_++;
  req->set_request_id(id);
  if (!rw_->Write(*req)) return End("write");
  client::v1::DecodeResponse resp;
  if (!rw_->Read(&resp)) return End("read");
  if (resp.request_id() != id) {  // one request in flight: the answer must be its own
    ctx_->TryCancel();
    End("read");
    final_status_ = absl::InternalError(absl::StrCat(
        "DecodeStream answered request ", resp.request_id(), " while ", id, " was in flight"));
    return final_status_;
  }
  return client::ParseDecodeResponse(resp);
}

}  // namespace sds::loadgen
