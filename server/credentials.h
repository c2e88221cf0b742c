// Who a caller is: the tenant its credentials name (server/README.md, "Tenants").
//
// Without credentials the tenant is a namespace only: x-tenant-id as the caller sets it
// ("default" without one); any caller can name any tenant. The single --auth_token keeps
// that namespace (every call needs the token, and x-tenant-id still picks the tenant, as
// before tokens named tenants). With tokens (--auth_tokens_file, --auth_tokens_env) every
// call needs "authorization: Bearer <token>", and its tenant is the one its token names; an
// x-tenant-id header may only repeat it (another value is PERMISSION_DENIED, never a
// switch of tenant). With --tenant_from_client_cert (mutual TLS) the tenant is the client
// certificate's common name, and a token, where tokens are required as well, must name
// the same tenant.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc {
class CallbackServerContext;
}

namespace sds::server {

inline constexpr size_t kMinTokenBytes = 16;

struct CallerAuthOptions {
  // "TENANT TOKEN" per line ('#' starts a comment; ';' also separates entries, for an
  // environment variable's value).
  std::string tokens_text;
  std::string where = "tokens";  // names the source in parse errors
  std::string single_token;      // --auth_token: one token, tenants by x-tenant-id
  bool tenant_from_client_cert = false;
};

class CallerAuth {
 public:
  // INVALID_ARGUMENT naming the line of a malformed entry, an invalid tenant name, a
  // listed token shorter than kMinTokenBytes, a token given twice, or a single token
  // beside a list.
  static absl::StatusOr<CallerAuth> Create(const CallerAuthOptions& options);
  CallerAuth() = default;  // no credentials: x-tenant-id namespacing

  // The caller's tenant. UNAUTHENTICATED without a valid token (when tokens are
  // configured) or without a client certificate (tenant_from_client_cert);
  // PERMISSION_DENIED when x-tenant-id names another tenant than the credentials;
  // INVALID_ARGUMENT for an x-tenant-id longer than 256 bytes.
  absl::StatusOr<std::string> TenantOf(const grpc::CallbackServerContext& context) const;

  // Tenants come from credentials, not from what the caller says.
  bool bound() const { return !tenant_of_token_.empty() || from_cert_; }
  // Every call needs a token or a client certificate.
  bool required() const { return bound() || !single_token_.empty(); }
  size_t num_tokens() const { return tenant_of_token_.size(); }

 private:
  absl::flat_hash_map<std::string, std::string> tenant_of_token_;
  std::string single_token_;
  bool from_cert_ = false;
};

// A valid tenant name: 1-256 printable ASCII bytes without spaces (metadata values are
// printable ASCII; the sequence key's separator cannot occur in one).
bool ValidTenantName(absl::string_view tenant);

}  // namespace sds::server
