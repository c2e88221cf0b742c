#include "server/decode_submit.h"

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/validate.h"

namespace sds::server {

absl::Status DecodeAdmission::Submit(const std::string& tenant,
                                     const sparse_decode::v1::DecodeRequest* request,
                                     sparse_decode::v1::DecodeResponse* response,
                                     Clock::time_point deadline, std::function<bool()> cancelled,
                                     std::function<void(const absl::Status&)> done,
                                     bool closes_batch) const {
  if (absl::Status s = ValidateDecode(*request, model_); !s.ok()) return s;
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
  DecodeWork work;
  work.request = request;
  work.response = response;
  work.key = key;
  work.deadline = deadline;
  work.cancelled = std::move(cancelled);
  work.closes_batch = closes_batch;
  work.done = [pending = pending_, key, layer, done = std::move(done)](const absl::Status& s) {
    pending->Remove(key, layer, 1);  // after the commit: the length already includes it
    done(s);
  };
  absl::Status queued = batcher_->SubmitDecode(std::move(work));
  if (!queued.ok()) pending_->Remove(key, layer, 1);
  return queued;
}

}  // namespace sds::server
