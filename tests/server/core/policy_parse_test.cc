#include "server/core/policy_parse.h"

#include <gtest/gtest.h>

#include <string>

namespace kvpack::server {
namespace {

constexpr char kGood[] = R"(# policies for a video DiT
policies:
  - name: wan-i2v
    rules:
      - blocks: [0, 3]          # the first blocks are the most sensitive
        timesteps: [800, 1000]
        roles: [text, reference]
        formats: [bf16, int8]
      - roles: generated
        max_rel_error: 0.03
      - formats: int4
  - name: flat
    rules:
      - blocks: 7
        formats: [int8]
)";

TEST(PolicyParse, ReadsEveryKey) {
  absl::StatusOr<std::vector<Policy>> p = ParsePolicies(kGood);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 2u);
  const Policy& wan = (*p)[0];
  EXPECT_EQ(wan.name, "wan-i2v");
  ASSERT_EQ(wan.rules.size(), 3u);
  const PolicyRule& r0 = wan.rules[0];
  EXPECT_EQ(r0.line, 5);
  EXPECT_EQ(r0.block_min, 0);
  EXPECT_EQ(r0.block_max, 3);
  EXPECT_EQ(r0.timestep_min, 800.0);
  EXPECT_EQ(r0.timestep_max, 1000.0);
  EXPECT_EQ(r0.roles, (std::vector<std::string>{"text", "reference"}));
  EXPECT_EQ(r0.formats, (std::vector<PageFormat>{PageFormat::kBf16, PageFormat::kInt8}));
  EXPECT_EQ(wan.rules[1].max_rel_error, 0.03);
  EXPECT_TRUE(wan.rules[1].formats.empty());
  EXPECT_TRUE(wan.rules[2].roles.empty());
  EXPECT_EQ((*p)[1].rules[0].block_min, 7);
  EXPECT_EQ((*p)[1].rules[0].block_max, 7);
}

TEST(PolicyParse, BadTextNamesTheLine) {
  const struct {
    std::string text;
    const char* want;
  } cases[] = {
      {"", "line 1: expected 'policies:' first"},
      {"rules:\n", "line 1: expected 'policies:' first"},
      {"policies:\n", "lists no policy"},
      {"policies:\n  - name: a\n", "line 2: policy 'a' has no rules"},
      {"policies:\n  - name: a\n    rules:\n      - formats: [int3]\n", "line 4: formats: 'int3' is not a format"},
      {"policies:\n  - name: a\n    rules:\n      - roles: video\n        formats: int4\n", "line 4: roles: 'video'"},
      {"policies:\n  - name: a\n    rules:\n      - blocks: [5, 2]\n        formats: int4\n", "line 4: blocks: low end"},
      {"policies:\n  - name: a\n    rules:\n      - blocks: -1\n        formats: int4\n", "line 4: blocks: '-1'"},
      {"policies:\n  - name: a\n    rules:\n      - timesteps: [0, inf]\n        formats: int4\n", "line 4: timesteps"},
      {"policies:\n  - name: a\n    rules:\n      - blocks: 1\n", "line 4: a rule needs exactly one"},
      {"policies:\n  - name: a\n    rules:\n      - formats: int4\n        max_rel_error: 0.1\n", "line 4: a rule needs"},
      {"policies:\n  - name: a\n    rules:\n      - max_rel_error: -2\n", "line 4: max_rel_error: '-2'"},
      {"policies:\n  - name: a\n    rules:\n      - formats: int4\n        formats: int8\n", "line 5: 'formats' given twice"},
      {"policies:\n  - name: a\n    rules:\n      - colour: red\n", "line 4: 'colour' is not a rule key"},
      {"policies:\n  - name: a\n    rules:\n      - formats: [int4\n", "line 4: formats: a list needs"},
      {"policies:\n  - name: a\n    rules:\n      - formats: int4\n  - name: a\n    rules:\n      - formats: int4\n",
       "line 5: policy 'a' is defined twice (first on line 2)"},
      {"policies:\n  - name: bad name!\n", "line 2: name:"},
      {"policies:\n  - name: a\n    owner: me\n", "line 3: 'owner' is not a policy key"},
      {"policies:\n  - name: a\n    rules:\n\t- formats: int4\n", "line 4: tabs"},
      {"policies:\n  - name: a\n    rules:\n      blocks 3\n", "line 4: expected 'key: value'"},
      {"policies:\n  - name: a\n    rules:\n      blocks: 3\n", "line 4: 'blocks' before the first rule"},
      {"policies:\n  formats: int4\n", "line 2: expected '- name: ...'"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<std::vector<Policy>> p = ParsePolicies(c.text);
    ASSERT_FALSE(p.ok()) << c.text;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(c.want), std::string::npos)
        << "wanted '" << c.want << "' in: " << p.status().message();
  }
  EXPECT_FALSE(ParsePolicies(std::string(kMaxPolicyTextBytes + 1, ' ')).ok());
}

TEST(PolicyParse, ErrorsQuoteABoundedPartOfTheLine) {
  const std::string text = "policies:\n  - name: " + std::string(100000, 'x') + "\n";
  const absl::Status s = ParsePolicies(text).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LE(s.message().size(), kMaxPolicyErrorChars + 32);
  EXPECT_NE(s.message().find("line 2"), std::string::npos);
}

}  // namespace
}  // namespace kvpack::server
