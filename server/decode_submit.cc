#include "server/decode_submit.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/validate.h"
#include "spdlog/spdlog.h"

namespace sds::server {

absl::Status DecodeAdmission::Admit(
    const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
    const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
    EncodedResponse* encoded, Clock::time_point deadline, std::function<bool()> cancelled,
    std::function<void(const absl::Status&)> done, DecodeWork* work, PendingHold* hold) const {
  if (absl::Status s = ValidateDecode(*request, bytes, model_); !s.ok()) return s;
  std::string key = SequenceKey(tenant, request->sequence_id());
  const int32_t layer = request->layer();
  uint64_t incarnation = 0;
  if (absl::Status s = pending_->CheckStart(*cache_, key, layer, request->position(),
                                            request->sequence_id(), &incarnation);
      !s.ok()) {
    return s;
  }
  if (Clock::now() > deadline) {
    return absl::DeadlineExceededError("deadline passed before the request was queued");
  }
  // Counted from here; if anything below throws, `hold` takes the count back.
  *hold = PendingHold(pending_, key, layer, 1);
  work->request = request;
  work->bytes = bytes;
  work->response = response;
  work->encoded = encoded;
  work->key = key;
  work->incarnation = incarnation;
  work->deadline = deadline;
  work->cancelled = std::move(cancelled);
  work->done = [pending = pending_, key = std::move(key), layer,
                done = std::move(done)](const absl::Status& s) {
    pending->Remove(key, layer, 1);  // after the commit: the length already includes it
    done(s);
  };
  return absl::OkStatus();
}

absl::Status DecodeAdmission::Prepare(
    const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
    const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
    EncodedResponse* encoded, Clock::time_point deadline, std::function<bool()> cancelled,
    std::function<void(const absl::Status&)> done, DecodeWork* work) const {
  PendingHold hold;
  if (absl::Status s = Admit(tenant, request, bytes, response, encoded, deadline,
                             std::move(cancelled), std::move(done), work, &hold);
      !s.ok()) {
    return s;
  }
  hold.Release();  // work->done removes the count
  return absl::OkStatus();
}

absl::Status DecodeAdmission::Submit(
    const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
    const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
    EncodedResponse* encoded, Clock::time_point deadline, std::function<bool()> cancelled,
    std::function<void(const absl::Status&)> done, Batcher::SubmitterRun* claim) const {
  DecodeWork work;
  PendingHold hold;  // removes the count on a refusal or an exception before it is queued
  if (absl::Status s = Admit(tenant, request, bytes, response, encoded, deadline,
                             std::move(cancelled), std::move(done), &work, &hold);
      !s.ok()) {
    return s;
  }
  absl::Status queued = batcher_->SubmitDecode(std::move(work), claim);
  if (queued.ok()) {
    hold.Release();  // the queued work's `done` removes it
  } else {
    hold.Undo();
  }
  return queued;
}

void DecodeAdmission::SubmitAll(std::vector<DecodeWork> works) const {
  if (works.empty()) return;
  works.back().closes_batch = true;
  std::vector<absl::Status> queued;
  try {
    queued = batcher_->SubmitDecodes(&works);
  } catch (const std::exception& e) {  // bad_alloc before any was queued
    spdlog::error("cannot queue {} decodes: {}", works.size(), e.what());
    queued.assign(works.size(), absl::InternalError(absl::StrCat(
                                    "internal error while queueing the request: ", e.what())));
  }
  for (size_t i = 0; i < works.size(); ++i) {
    if (!queued[i].ok()) works[i].done(queued[i]);  // also removes it from pending
  }
}

}  // namespace sds::server
