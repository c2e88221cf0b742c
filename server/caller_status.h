// Errors as the caller sees them: the cache and the batching engine name a sequence by
// its tenant-qualified key (auth.h), a caller by its own id.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace sds::server {

// Replaces the key with the id in the message, keeps the code; NOT_FOUND gets one
// standard message.
absl::Status ForCaller(const absl::Status& status, absl::string_view key,
                       absl::string_view sequence_id);

}  // namespace sds::server
