#include "server/decode_submit.h"

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/validate.h"

namespace sds::server {

absl::Status DecodeAdmission::Prepare(
    const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
    const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
    EncodedResponse* encoded, Clock::time_point deadline, std::function<bool()> cancelled,
    std::function<void(const absl::Status&)> done, DecodeWork* work) const {
  if (absl::Status s = ValidateDecode(*request, bytes, model_); !s.ok()) return s;
  std::string key = SequenceKey(tenant, request->sequence_id());
  const int32_t layer = request->layer();
  if (absl::Status s =
          pending_->CheckStart(*cache_, key, layer, request->position(), request->sequence_id());
      !s.ok()) {
    return s;
  }
  if (Clock::now() > deadline) {
    return absl::DeadlineExceededError("deadline passed before the request was queued");
  }
  pending_->Add(key, layer, 1);
  work->request = request;
  work->bytes = bytes;
  work->response = response;
  work->encoded = encoded;
  work->key = key;
  work->deadline = deadline;
  work->cancelled = std::move(cancelled);
  work->done = [pending = pending_, key, layer, done = std::move(done)](const absl::Status& s) {
    pending->Remove(key, layer, 1);  // after the commit: the length already includes it
    done(s);
  };
  return absl::OkStatus();
}

absl::Status DecodeAdmission::Submit(
    const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
    const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
    EncodedResponse* encoded, Clock::time_point deadline, std::function<bool()> cancelled,
    std::function<void(const absl::Status&)> done, Batcher::SubmitterRun* claim) const {
  DecodeWork work;
  if (absl::Status s = Prepare(tenant, request, bytes, response, encoded, deadline,
                               std::move(cancelled), std::move(done), &work);
      !s.ok()) {
    return s;
  }
  const std::string key = work.key;
  const int32_t layer = request->layer();
  absl::Status queued = batcher_->SubmitDecode(std::move(work), claim);
  if (!queued.ok()) pending_->Remove(key, layer, 1);
  return queued;
}

void DecodeAdmission::SubmitAll(std::vector<DecodeWork> works) const {
  if (works.empty()) return;
  works.back().closes_batch = true;
  std::vector<absl::Status> queued = batcher_->SubmitDecodes(&works);
  for (size_t i = 0; i < works.size(); ++i) {
    if (!queued[i].ok()) works[i].done(queued[i]);  // also removes it from pending
  }
}

}  // namespace sds::server
