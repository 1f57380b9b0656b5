#include "server/core/policy.h"

#include <gtest/gtest.h>

#include "server/core/policy_parse.h"

namespace kvpack::server {
namespace {

// Rules in file order: the first match wins.
constexpr char kPolicy[] = R"(policies:
  - name: p
    rules:
      - blocks: [0, 1]
        formats: [bf16]
      - roles: text
        timesteps: [0.5, 1.0]
        formats: [int8, int4]
      - roles: [generated, audio]
        max_rel_error: 0.02
      - formats: [int4]
)";

Policy Parsed() {
  absl::StatusOr<std::vector<Policy>> p = ParsePolicies(kPolicy);
  EXPECT_TRUE(p.ok()) << p.status();
  return p->front();
}

TEST(Policy, FirstMatchingRuleWins) {
  const Policy p = Parsed();
  EXPECT_EQ(MatchRule(p, 0, 0.9, "text")->line, 4);   // block 0: rule 1 before the text rule
  EXPECT_EQ(MatchRule(p, 5, 0.9, "text")->line, 6);
  EXPECT_EQ(MatchRule(p, 5, 0.2, "text")->line, 11);  // timestep outside the text rule: the catch-all
  EXPECT_EQ(MatchRule(p, 5, 1.0, "text")->line, 6);   // ranges are inclusive
  EXPECT_EQ(MatchRule(p, 5, 0.9, "audio")->line, 9);
  EXPECT_EQ(MatchRule(p, 5, 0.9, "")->line, 11);      // no role: only role-free rules
  Policy narrow = p;
  narrow.rules.pop_back();
  EXPECT_EQ(MatchRule(narrow, 5, 0.9, "reference"), nullptr);
}

TEST(Policy, TheCallersOwnPrecisionComesFirst) {
  const Policy p = Parsed();
  LayerRequest r;
  r.block_index = 4;
  r.timestep = 0.7;
  r.ranges.resize(4);
  r.ranges[0].role = "text";
  r.ranges[0].precision_given = false;
  r.ranges[0].allowed = {PageFormat::kInt4};  // the converter's default
  r.ranges[1].role = "text";
  r.ranges[1].allowed = {PageFormat::kBf16};  // given by the caller
  r.ranges[2].role = "generated";
  r.ranges[2].precision_given = false;
  r.ranges[3].role = "reference";
  r.ranges[3].precision_given = false;
  ApplyPolicy(p, &r);
  EXPECT_EQ(r.ranges[0].allowed, (std::vector<PageFormat>{PageFormat::kInt8, PageFormat::kInt4}));
  EXPECT_EQ(r.ranges[1].allowed, (std::vector<PageFormat>{PageFormat::kBf16}));
  EXPECT_EQ(r.ranges[2].max_rel_error, 0.02);  // resolved later by the planner against the estimate
  EXPECT_EQ(r.ranges[3].allowed, (std::vector<PageFormat>{PageFormat::kInt4}));
}

TEST(Policy, RegistryResolvesByNameAndRefusesDuplicates) {
  PolicyRegistry registry;
  ASSERT_TRUE(registry.Add({Parsed()}).ok());
  EXPECT_EQ(registry.Add({Parsed()}).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.size(), 1u);
  LayerRequest r;
  r.ranges.resize(1);
  r.ranges[0].precision_given = false;
  r.block_index = 1;
  r.policy = "p";
  ASSERT_TRUE(registry.Resolve(&r).ok());
  EXPECT_EQ(r.ranges[0].allowed, (std::vector<PageFormat>{PageFormat::kBf16}));
  r.policy = "q";
  const absl::Status s = registry.Resolve(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("header.policy"), std::string::npos);
}

TEST(Policy, RegistryHoldsAtMostItsLimit) {
  PolicyRegistry registry;
  std::vector<Policy> batch;
  for (size_t i = 0; i < kMaxRegisteredPolicies; ++i) {
    Policy p = Parsed();
    p.name = "p" + std::to_string(i);
    batch.push_back(std::move(p));
  }
  ASSERT_TRUE(registry.Add(std::move(batch)).ok());
  Policy one_more = Parsed();
  one_more.name = "over";
  const absl::Status s = registry.Add({one_more});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("limit"), std::string::npos);
  EXPECT_EQ(registry.size(), kMaxRegisteredPolicies);
}

}  // namespace
}  // namespace kvpack::server
