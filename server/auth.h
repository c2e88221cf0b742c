// Tenancy in the cache: sequence keys qualified by tenant (the tenant itself comes from
// credentials.h).
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace sds::server {

// The cache key of a sequence: tenants never see each other's sequences. Metadata
// values are printable ASCII, so the separator cannot occur in a tenant.
std::string SequenceKey(absl::string_view tenant, absl::string_view sequence_id);

// The tenant used for the server's own start-up self-test (unreachable from a client).
inline constexpr absl::string_view kInternalTenant = "\x01internal";

}  // namespace sds::server
