#include "server/decode_submit.h"

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/validate.h"

namespace sds::server {

absl::Status DecodeAdmission::Submit(const std::string& tenant,
                                     const sparse_decode::v1::DecodeRequest* request,
                                     sparse_decode::v1::DecodeResponse* response,
                                     Clock::time_point deadline, std::function<bool()> cancelled,
                                     std::function<void(const absl::Status&)> done) const {
  if (absl::Status s = ValidateDecode(*request, model_); !s.ok()) return s;
  std::string key = SequenceKey(tenant, request->sequence_id());
  if (!cache_->Contains(key)) {
    return absl::NotFoundError(absl::StrCat("sequence '", request->sequence_id(),
                                            "' not found; call CreateSequence first"));
  }
  if (Clock::now() > deadline) {
    return absl::DeadlineExceededError("deadline passed before the request was queued");
  }
  DecodeWork work;
  work.request = request;
  work.response = response;
  work.key = std::move(key);
  work.deadline = deadline;
  work.cancelled = std::move(cancelled);
  work.done = std::move(done);
  return batcher_->SubmitDecode(std::move(work));
}

}  // namespace sds::server
