// Authentication (optional bearer token) and tenancy (metadata x-tenant-id).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class CallbackServerContext;
}

namespace sds::server {

// Returns the caller's tenant ("default" without x-tenant-id). UNAUTHENTICATED when
// `auth_token` is non-empty and the call lacks "authorization: Bearer <auth_token>".
absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext& context,
                                         const std::string& auth_token);

// The cache key of a sequence: tenants never see each other's sequences. Metadata
// values are printable ASCII, so the separator cannot occur in a tenant.
std::string SequenceKey(absl::string_view tenant, absl::string_view sequence_id);

// The tenant used for the server's own start-up self-test (unreachable from a client).
inline constexpr absl::string_view kInternalTenant = "\x01internal";

}  // namespace sds::server
