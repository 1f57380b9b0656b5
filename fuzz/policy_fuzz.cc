// Fuzz target: the precision-policy parser (server/core/policy_parse.h: kvpackd --policy_file and the
// RegisterPolicies RPC) on arbitrary text. Accepted text must give bounded, valid policies (names in
// their alphabet and length, at most kMaxPolicies, every rule with exactly one of formats and
// max_rel_error, ranges ordered); refusals must be INVALID_ARGUMENT with a bounded message.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "server/core/policy_parse.h"

namespace {

void Fail(const char* what) {
  std::fprintf(stderr, "policy_fuzz: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpack::server;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<std::vector<Policy>> policies = ParsePolicies(text);
  if (!policies.ok()) {
    if (policies.status().code() != absl::StatusCode::kInvalidArgument) Fail("refusal that is not INVALID_ARGUMENT");
    if (policies.status().message().empty()) Fail("refusal without a message");
    if (policies.status().message().size() > kMaxPolicyErrorChars + 32) Fail("an unbounded error message");
    return 0;
  }
  if (policies->size() > kMaxPolicies) Fail("more policies than kMaxPolicies");
  size_t rules = 0;
  for (const Policy& p : *policies) {
    if (p.name.empty() || p.name.size() > 64) Fail("policy name length");
    for (const PolicyRule& r : p.rules) {
      ++rules;
      if (r.formats.empty() == !(r.max_rel_error > 0.0)) Fail("a rule without exactly one of formats, max_rel_error");
      if (r.block_min > r.block_max || !(r.timestep_min <= r.timestep_max)) Fail("an empty range");
      for (const std::string& role : r.roles) {
        if (!IsRangeRole(role)) Fail("an unknown role accepted");
      }
    }
  }
  if (rules > kMaxPolicyRules) Fail("more rules than kMaxPolicyRules");
  return 0;
}
