// Precision policies by transformer block, diffusion timestep and range role (issue 15): a named
// list of rules, each mapping (block index range, timestep range, roles) to formats or an error
// budget. A request names a policy with its block index and timestep; ranges that name neither
// formats nor an error budget take the first matching rule's.
//
// Precedence, highest first:
//   1. the range's own allowed_formats or max_rel_error (the caller's word is final);
//   2. the first rule of the policy, in file order, whose block range, timestep range and roles
//      all match (a rule without roles matches every role, the empty one included);
//   3. the default: [INT4].
// Pure: no I/O, no locks except PolicyRegistry's. The text format is policy_parse.h.
#pragma once

#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/format.h"
#include "server/core/layer_request.h"

namespace kvpack::server {

// The roles a range may name (TokenRange.role).
inline constexpr const char* kRangeRoles[] = {"text", "reference", "audio", "generated"};
bool IsRangeRole(const std::string& role);

struct PolicyRule {
  int line = 0;  // of its definition in the policy text (messages, precedence tests)
  int block_min = 0;
  int block_max = std::numeric_limits<int>::max();  // inclusive
  double timestep_min = -std::numeric_limits<double>::infinity();
  double timestep_max = std::numeric_limits<double>::infinity();  // inclusive
  std::vector<std::string> roles;  // empty: every role
  // Exactly one of the two:
  std::vector<PageFormat> formats;  // best first
  double max_rel_error = 0.0;

  bool Matches(int block, double timestep, const std::string& role) const;
};

struct Policy {
  std::string name;
  std::vector<PolicyRule> rules;
};

// The first rule of `policy` matching (block, timestep, role), or null.
const PolicyRule* MatchRule(const Policy& policy, int block, double timestep, const std::string& role);

// Fills the ranges of `request` that gave no precision (RangeRequest::precision_given false) from
// `policy` at request->block_index and request->timestep; the others are left alone.
void ApplyPolicy(const Policy& policy, LayerRequest* request);

// Policies one daemon holds at most (they live until it exits, shared by all tenants): every
// RegisterPolicies call is bounded by the parser's limits, this bounds them all together.
inline constexpr size_t kMaxRegisteredPolicies = 1024;

// The daemon's policies: loaded at start (--policy_file) and registered over the API; at most
// kMaxRegisteredPolicies (RESOURCE_EXHAUSTED beyond). Thread-safe.
class PolicyRegistry {
 public:
  // Adds `policies`; ALREADY_EXISTS naming the first name already present (nothing is added then).
  absl::Status Add(std::vector<Policy> policies);
  // NOT_FOUND naming the policy when unknown.
  absl::StatusOr<std::shared_ptr<const Policy>> Get(const std::string& name) const;
  // request->policy resolved and applied (no-op when empty); NOT_FOUND names header.policy.
  absl::Status Resolve(LayerRequest* request) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const Policy>> policies_;
};

}  // namespace kvpack::server
