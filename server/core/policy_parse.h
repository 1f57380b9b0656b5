// The text of precision policies (kvpackd --policy_file, RegisterPolicies): a small YAML subset.
//
//   # comments run to the end of a line; indentation is spaces only
//   policies:
//     - name: wan-i2v                  # [A-Za-z0-9_.-], 1..64 characters, unique
//       rules:                         # first match wins (server/core/policy.h)
//         - blocks: [0, 3]             # inclusive block index range, or one index: blocks: 7
//           timesteps: [800, 1000]     # inclusive, finite, or one value; default: every timestep
//           roles: [text, reference]   # text | reference | audio | generated; default: every role
//           formats: [bf16, int8]      # best first: int4 | int8 | bf16
//         - roles: generated
//           max_rel_error: 0.03        # instead of formats (exactly one of the two)
//
// A rule starts at a "- key: value" line under "rules:"; its other keys follow, one per line.
// Errors name the line ("line 7: roles: 'video' is not a role (text, reference, audio,
// generated)"). Bounded: at most kMaxPolicyTextBytes of text, kMaxPolicies policies and
// kMaxPolicyRules rules in all.
#pragma once

#include <cstddef>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/policy.h"

namespace kvpack::server {

inline constexpr size_t kMaxPolicyTextBytes = 1 << 20;
inline constexpr size_t kMaxPolicies = 256;
inline constexpr size_t kMaxPolicyRules = 4096;
inline constexpr size_t kMaxPolicyErrorChars = 200;  // of an error message after "line N: "

// The policies of `text`, validated; INVALID_ARGUMENT naming the line otherwise.
absl::StatusOr<std::vector<Policy>> ParsePolicies(absl::string_view text);

}  // namespace kvpack::server
