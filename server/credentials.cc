#include "server/credentials.h"

#include <grpcpp/security/auth_context.h>
#include <grpcpp/server_context.h>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace sds::server {
namespace {

absl::string_view Metadata(const grpc::CallbackServerContext& context, absl::string_view key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return {};
  return absl::string_view(it->second.data(), it->second.size());
}

// The client certificate's common name, or empty (no certificate, or no CN).
std::string CertificateTenant(const grpc::CallbackServerContext& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return {};
  for (const grpc::string_ref& cn : auth->FindPropertyValues("x509_common_name"))
    return std::string(cn.data(), cn.size());
  return {};
}

// Comparison whose time does not depend on where the strings differ.
bool SameSecret(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ (i < b.size() ? b[i] : 0);
  return diff == 0;
}

}  // namespace

bool ValidTenantName(absl::string_view tenant) {
  if (tenant.empty() || tenant.size() > 256) return false;
  for (char c : tenant)
    if (c <= ' ' || c > '~') return false;
  return true;
}

absl::StatusOr<CallerAuth> CallerAuth::Create(const CallerAuthOptions& options) {
  CallerAuth auth;
  auth.from_cert_ = options.tenant_from_client_cert;
  // `checked_length`: the listed tokens; --auth_token keeps what it accepted before
  // (the server warns about a short one).
  auto add = [&](const std::string& tenant, const std::string& token, const std::string& where,
                 bool checked_length) -> absl::Status {
    if (!ValidTenantName(tenant)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": tenant '", tenant, "' must be 1-256 printable ASCII bytes without spaces"));
    }
    if (checked_length && token.size() < kMinTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the token of tenant '", tenant,
                                                     "' is shorter than ", kMinTokenBytes,
                                                     " bytes"));
    }
    if (!auth.tenant_of_token_.emplace(token, tenant).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": a token is given twice (tenant '", tenant, "')"));
    }
    return absl::OkStatus();
  };
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(options.tokens_text, absl::ByAnyChar("\n;"))) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat(options.where, " entry ", line_number);
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected 'TENANT TOKEN', got ", fields.size(), " fields"));
    }
    if (absl::Status s = add(std::string(fields[0]), std::string(fields[1]), where, true); !s.ok())
      return s;
  }
  if (!options.single_token.empty() && !auth.tenant_of_token_.empty()) {
    return absl::InvalidArgumentError(
        "give --auth_token (one token, tenants by x-tenant-id) or a token list, not both");
  }
  auth.single_token_ = options.single_token;
  return auth;
}

absl::StatusOr<std::string> CallerAuth::TenantOf(const grpc::CallbackServerContext& context) const {
  absl::string_view header = Metadata(context, "x-tenant-id");
  if (header.size() > 256) {
    return absl::InvalidArgumentError("metadata 'x-tenant-id' is longer than 256 bytes");
  }
  std::string tenant;
  if (from_cert_) {
    tenant = CertificateTenant(context);
    if (tenant.empty()) {
      return absl::UnauthenticatedError(
          "no client certificate with a common name (the server takes the tenant from it)");
    }
    if (!ValidTenantName(tenant)) {
      return absl::UnauthenticatedError(
          "the client certificate's common name is not a tenant name (1-256 printable ASCII "
          "bytes without spaces)");
    }
  }
  if (!tenant_of_token_.empty()) {
    absl::string_view authorization = Metadata(context, "authorization");
    if (authorization.empty()) {
      return absl::UnauthenticatedError(
          "missing metadata 'authorization: Bearer <token>' (the server requires a token)");
    }
    absl::string_view token = authorization;
    // A hash lookup: a guess is compared with a configured token only when their hashes
    // match, so its time tells next to nothing about how much of a token it got right.
    auto it = absl::ConsumePrefix(&token, "Bearer ") ? tenant_of_token_.find(token)
                                                     : tenant_of_token_.end();
    if (it == tenant_of_token_.end()) {
      return absl::UnauthenticatedError("invalid bearer token in metadata 'authorization'");
    }
    if (!tenant.empty() && tenant != it->second) {
      return absl::PermissionDeniedError(
          "the bearer token belongs to another tenant than the client certificate");
    }
    tenant = it->second;
  }
  if (!single_token_.empty()) {
    absl::string_view authorization = Metadata(context, "authorization");
    if (authorization.empty()) {
      return absl::UnauthenticatedError(
          "missing metadata 'authorization: Bearer <token>' (the server requires a token)");
    }
    if (!absl::ConsumePrefix(&authorization, "Bearer ") ||
        !SameSecret(authorization, single_token_)) {
      return absl::UnauthenticatedError("invalid bearer token in metadata 'authorization'");
    }
  }
  if (!bound()) return header.empty() ? std::string("default") : std::string(header);
  if (!header.empty() && header != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("metadata 'x-tenant-id' names another tenant than the caller's credentials ('",
                     tenant, "'); leave it out or repeat it"));
  }
  return tenant;
}

}  // namespace sds::server
