#include "server/core/policy.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvpack::server {

bool IsRangeRole(const std::string& role) {
  return std::any_of(std::begin(kRangeRoles), std::end(kRangeRoles), [&](const char* r) { return role == r; });
}

bool PolicyRule::Matches(int block, double timestep, const std::string& role) const {
  if (block < block_min || block > block_max) return false;
  if (timestep < timestep_min || timestep > timestep_max) return false;
  return roles.empty() || std::find(roles.begin(), roles.end(), role) != roles.end();
}

const PolicyRule* MatchRule(const Policy& policy, int block, double timestep, const std::string& role) {
  for (const PolicyRule& rule : policy.rules) {
    if (rule.Matches(block, timestep, role)) return &rule;
  }
  return nullptr;
}

void ApplyPolicy(const Policy& policy, LayerRequest* request) {
  for (RangeRequest& range : request->ranges) {
    if (range.precision_given) continue;
    const PolicyRule* rule = MatchRule(policy, request->block_index, request->timestep, range.role);
    if (rule == nullptr) continue;
    if (!rule->formats.empty()) {
      range.allowed = rule->formats;
      range.max_rel_error = 0.0;
    } else {
      range.max_rel_error = rule->max_rel_error;  // resolved by the planner against the estimate
    }
  }
}

absl::Status PolicyRegistry::Add(std::vector<Policy> policies) {
  std::lock_guard<std::mutex> lock(mu_);
  if (policies_.size() + policies.size() > kMaxRegisteredPolicies) {
    return absl::ResourceExhaustedError(absl::StrCat("policies: ", policies_.size(), " registered + ", policies.size(),
                                                     " new > ", kMaxRegisteredPolicies, " (the daemon's limit)"));
  }
  for (const Policy& p : policies) {
    if (policies_.count(p.name) != 0) return absl::AlreadyExistsError(absl::StrCat("policy \"", p.name, "\" exists"));
  }
  for (Policy& p : policies) {
    std::string name = p.name;
    policies_.emplace(std::move(name), std::make_shared<const Policy>(std::move(p)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Policy>> PolicyRegistry::Get(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = policies_.find(name);
  if (it == policies_.end()) return absl::NotFoundError(absl::StrCat("header.policy: no policy named \"", name, "\""));
  return it->second;
}

absl::Status PolicyRegistry::Resolve(LayerRequest* request) const {
  if (request->policy.empty()) return absl::OkStatus();
  absl::StatusOr<std::shared_ptr<const Policy>> policy = Get(request->policy);
  if (!policy.ok()) return policy.status();
  ApplyPolicy(**policy, request);
  return absl::OkStatus();
}

size_t PolicyRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return policies_.size();
}

}  // namespace kvpack::server
