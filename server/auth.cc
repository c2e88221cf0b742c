#include "server/auth.h"

#include <grpcpp/server_context.h>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace sds::server {
namespace {

constexpr char kSeparator = '\x1f';

absl::string_view Lookup(const grpc::CallbackServerContext& context, absl::string_view key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return {};
  return absl::string_view(it->second.data(), it->second.size());
}

// Comparison whose time does not depend on where the strings differ.
bool SameSecret(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ (i < b.size() ? b[i] : 0);
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> Authenticate(const grpc::CallbackServerContext& context,
                                         const std::string& auth_token) {
  if (!auth_token.empty()) {
    absl::string_view header = Lookup(context, "authorization");
    if (header.empty()) {
      return absl::UnauthenticatedError(
          "missing metadata 'authorization: Bearer <token>' (the server requires a token)");
    }
    constexpr absl::string_view kBearer = "Bearer ";
    if (!absl::StartsWith(header, kBearer) ||
        !SameSecret(header.substr(kBearer.size()), auth_token)) {
      return absl::UnauthenticatedError("invalid bearer token in metadata 'authorization'");
    }
  }
  absl::string_view tenant = Lookup(context, "x-tenant-id");
  if (tenant.empty()) return std::string("default");
  if (tenant.size() > 256) {
    return absl::InvalidArgumentError("metadata 'x-tenant-id' is longer than 256 bytes");
  }
  return std::string(tenant);
}

std::string SequenceKey(absl::string_view tenant, absl::string_view sequence_id) {
  return absl::StrCat(tenant, absl::string_view(&kSeparator, 1), sequence_id);
}

}  // namespace sds::server
