#include "server/service/auth.h"

#include <fstream>
#include <sstream>
#include <string_view>

#include <grpcpp/support/byte_buffer.h>

#include "absl/strings/str_cat.h"
#include "server/runtime/bounded.h"

namespace kvpack::server {
namespace {

// Compares without an early exit, so timing does not reveal how much of a token matched.
bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  return diff == 0;
}

}  // namespace

bool ValidTenantName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  }
  return true;
}

absl::StatusOr<Auth> Auth::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth_token_file=", path, ": cannot be read"));
  std::map<std::string, std::string> tokens;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream fields(line);
    std::string token, tenant, extra;
    if (!(fields >> token)) continue;
    fields >> tenant;
    if (fields >> extra) return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": expected TOKEN [TENANT]"));
    if (token.size() < 16) return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": token shorter than 16 characters"));
    if (!tenant.empty() && !ValidTenantName(tenant)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": bad tenant name \"", tenant, "\""));
    }
    tokens[token] = tenant;
  }
  if (tokens.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth_token_file=", path, ": no tokens"));
  return FromTokens(std::move(tokens));
}

Auth Auth::FromTokens(std::map<std::string, std::string> token_to_tenant) {
  Auth auth;
  auth.tokens_ = std::move(token_to_tenant);
  return auth;
}

absl::StatusOr<std::string> Auth::Authorize(const std::multimap<grpc::string_ref, grpc::string_ref>& md) const {
  std::string tenant;
  if (auto it = md.find(kTenantHeader); it != md.end()) tenant.assign(it->second.data(), it->second.size());
  // The token first: a caller without a valid one learns nothing about what else is wrong.
  const std::string* bound = nullptr;
  if (!tokens_.empty()) {
    auto it = md.find("authorization");
    if (it == md.end()) return absl::UnauthenticatedError("authorization: a bearer token is required");
    const std::string_view value(it->second.data(), it->second.size());
    constexpr std::string_view kBearer = "Bearer ";
    if (value.substr(0, kBearer.size()) != kBearer) {
      return absl::UnauthenticatedError("authorization: expected \"Bearer <token>\"");
    }
    const std::string token(value.substr(kBearer.size()));
    for (const auto& [known, known_tenant] : tokens_) {
      if (ConstantTimeEquals(token, known)) bound = &known_tenant;
    }
    if (bound == nullptr) return absl::UnauthenticatedError("authorization: unknown token");
  }
  if (!tenant.empty() && !ValidTenantName(tenant)) {
    return absl::InvalidArgumentError(absl::StrCat(kTenantHeader, ": \"", Bounded(tenant),
                                                   "\" is not a tenant name (1-64 of A-Z a-z 0-9 . _ -)"));
  }
  if (bound == nullptr || bound->empty()) return tenant.empty() ? std::string(kDefaultTenant) : tenant;
  if (!tenant.empty() && tenant != *bound) {
    return absl::PermissionDeniedError(absl::StrCat("this token may not act as tenant \"", tenant, "\""));
  }
  return *bound;
}

namespace {

class ReflectionAuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ReflectionAuthInterceptor(const Auth* auth) : auth_(auth) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const absl::StatusOr<std::string> tenant = auth_->Authorize(*methods->GetRecvInitialMetadata());
      if (!tenant.ok()) denied_ = grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(tenant.status().message()));
    }
    if (!denied_.ok() && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      grpc::Slice empty;
      *methods->GetSerializedSendMessage() = grpc::ByteBuffer(&empty, 1);  // an empty response
    }
    if (!denied_.ok() && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(denied_);
    }
    methods->Proceed();
  }

 private:
  const Auth* const auth_;
  grpc::Status denied_;  // OK until the metadata is found wanting
};

class ReflectionAuthFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit ReflectionAuthFactory(const Auth* auth) : auth_(auth) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    constexpr std::string_view kReflection = "/grpc.reflection.";
    const std::string_view method = info->method() != nullptr ? info->method() : "";
    if (!auth_->required() || method.substr(0, kReflection.size()) != kReflection) return nullptr;
    return new ReflectionAuthInterceptor(auth_);
  }

 private:
  const Auth* const auth_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewReflectionAuthInterceptor(
    const Auth* auth) {
  return std::make_unique<ReflectionAuthFactory>(auth);
}

}  // namespace kvpack::server
