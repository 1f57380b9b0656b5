// Who is calling: bearer-token authentication and the tenant of a call.
//
// Token file: one token per line, optionally followed by whitespace and a tenant name; '#' starts a
// comment. A token with a tenant may act only as that tenant (x-kvpack-tenant absent or equal;
// anything else is PERMISSION_DENIED); a token without one may name any tenant. With no token file
// every call is accepted (the daemon refuses to start that way unless it listens on loopback or a
// unix socket).
//
// Thread safety: immutable after construction.
#pragma once

#include <map>
#include <memory>
#include <string>

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/status/statusor.h"

namespace kvpack::server {

inline constexpr char kTenantHeader[] = "x-kvpack-tenant";
inline constexpr char kDefaultTenant[] = "default";

class Auth {
 public:
  Auth() = default;  // open: no tokens
  static absl::StatusOr<Auth> FromFile(const std::string& path);
  static Auth FromTokens(std::map<std::string, std::string> token_to_tenant);

  bool required() const { return !tokens_.empty(); }
  // The tenant of the call, or UNAUTHENTICATED / PERMISSION_DENIED / INVALID_ARGUMENT.
  absl::StatusOr<std::string> Authorize(const grpc::CallbackServerContext& context) const {
    return Authorize(context.client_metadata());
  }
  absl::StatusOr<std::string> Authorize(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

 private:
  std::map<std::string, std::string> tokens_;  // token → tenant ("" for any)
};

// Tenant names: 1 to 64 characters of [A-Za-z0-9._-].
bool ValidTenantName(const std::string& name);

// Server reflection (grpc.reflection.*) is registered by gRPC's plugin, outside KvpackService, so
// it does not pass Admit(): with tokens required, this interceptor answers its calls without a
// valid token with empty messages (the descriptors are not sent) and ends them UNAUTHENTICATED.
// Health (grpc.health.v1) stays open for probes. `auth` must outlive the server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewReflectionAuthInterceptor(
    const Auth* auth);

}  // namespace kvpack::server
