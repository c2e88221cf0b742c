#include "server/caller_status.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace sds::server {

absl::Status ForCaller(const absl::Status& status, absl::string_view key,
                       absl::string_view sequence_id) {
  if (status.ok()) return status;
  if (status.code() == absl::StatusCode::kNotFound) {
    return absl::NotFoundError(absl::StrCat("sequence '", sequence_id,
                                            "' not found (released, or never created by this "
                                            "tenant)"));
  }
  std::string message = absl::StrReplaceAll(status.message(), {{key, sequence_id}});
  return absl::Status(status.code(), message);
}

}  // namespace sds::server
