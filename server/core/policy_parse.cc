#include "server/core/policy_parse.h"

#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvpack::server {
namespace {

// Messages quote the text they refuse; a line may be as long as the whole text (1 MiB), so the quote
// is cut at kMaxPolicyErrorChars (the service echoes no unbounded client input).
absl::Status LineError(int line, const std::string& what) {
  if (what.size() <= kMaxPolicyErrorChars) return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what.substr(0, kMaxPolicyErrorChars), "…"));
}

// "[a, b]" → {"a", "b"}; "a" → {"a"}; "[]" → {}.
absl::StatusOr<std::vector<std::string>> ListOf(absl::string_view value, int line, absl::string_view key) {
  std::vector<std::string> out;
  if (absl::ConsumePrefix(&value, "[")) {
    if (!absl::ConsumeSuffix(&value, "]")) return LineError(line, absl::StrCat(key, ": a list needs its closing ']'"));
    if (absl::StripAsciiWhitespace(value).empty()) return out;
    for (absl::string_view item : absl::StrSplit(value, ',')) {
      item = absl::StripAsciiWhitespace(item);
      if (item.empty()) return LineError(line, absl::StrCat(key, ": empty list item"));
      out.emplace_back(item);
    }
    return out;
  }
  if (value.empty()) return LineError(line, absl::StrCat(key, ": needs a value"));
  out.emplace_back(value);
  return out;
}

// One value or a [lo, hi] pair of numbers, lo ≤ hi.
template <typename T>
absl::Status RangeOf(absl::string_view value, int line, absl::string_view key, T* lo, T* hi) {
  absl::StatusOr<std::vector<std::string>> items = ListOf(value, line, key);
  if (!items.ok()) return items.status();
  if (items->size() != 1 && items->size() != 2) {
    return LineError(line, absl::StrCat(key, ": expected one number or [low, high]"));
  }
  T v[2];
  for (size_t i = 0; i < items->size(); ++i) {
    bool ok;
    if constexpr (std::is_same_v<T, int>) {
      ok = absl::SimpleAtoi((*items)[i], &v[i]) && v[i] >= 0;
    } else {
      ok = absl::SimpleAtod((*items)[i], &v[i]) && std::isfinite(v[i]);
    }
    if (!ok) {
      return LineError(line, absl::StrCat(key, ": '", (*items)[i], "' is not a ",
                                          std::is_same_v<T, int> ? "block index (integer >= 0)" : "finite number"));
    }
  }
  *lo = v[0];
  *hi = items->size() == 2 ? v[1] : v[0];
  if (*lo > *hi) return LineError(line, absl::StrCat(key, ": low end above high end"));
  return absl::OkStatus();
}

absl::Status SetRuleKey(const std::string& key, absl::string_view value, int line, PolicyRule* rule) {
  if (key == "blocks") return RangeOf<int>(value, line, key, &rule->block_min, &rule->block_max);
  if (key == "timesteps") return RangeOf<double>(value, line, key, &rule->timestep_min, &rule->timestep_max);
  if (key == "roles") {
    absl::StatusOr<std::vector<std::string>> roles = ListOf(value, line, key);
    if (!roles.ok()) return roles.status();
    for (const std::string& r : *roles) {
      if (!IsRangeRole(r)) {
        return LineError(line, absl::StrCat("roles: '", r, "' is not a role (text, reference, audio, generated)"));
      }
    }
    rule->roles = *roles;
    return absl::OkStatus();
  }
  if (key == "formats") {
    absl::StatusOr<std::vector<std::string>> names = ListOf(value, line, key);
    if (!names.ok()) return names.status();
    if (names->empty()) return LineError(line, "formats: at least one format");
    for (const std::string& n : *names) {
      PageFormat f;
      if (n == "int4") f = PageFormat::kInt4;
      else if (n == "int8") f = PageFormat::kInt8;
      else if (n == "bf16") f = PageFormat::kBf16;
      else return LineError(line, absl::StrCat("formats: '", n, "' is not a format (int4, int8, bf16)"));
      rule->formats.push_back(f);
    }
    return absl::OkStatus();
  }
  if (key == "max_rel_error") {
    double e;
    if (!absl::SimpleAtod(value, &e) || !(e > 0.0) || !std::isfinite(e)) {
      return LineError(line, absl::StrCat("max_rel_error: '", value, "' is not a positive number"));
    }
    rule->max_rel_error = e;
    return absl::OkStatus();
  }
  return LineError(line, absl::StrCat("'", key, "' is not a rule key (blocks, timesteps, roles, formats, max_rel_error)"));
}

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
}

}  // namespace

absl::StatusOr<std::vector<Policy>> ParsePolicies(absl::string_view text) {
  if (text.size() > kMaxPolicyTextBytes) {
    return absl::InvalidArgumentError(absl::StrCat("policy text of ", text.size(), " bytes, at most ",
                                                   kMaxPolicyTextBytes));
  }
  std::vector<Policy> policies;
  std::vector<int> policy_lines;
  std::vector<std::vector<std::string>> rule_keys;  // keys seen in the current rule
  bool saw_root = false, in_rules = false;
  size_t n_rules = 0;
  int line = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line;
    if (const size_t hash = raw.find('#'); hash != absl::string_view::npos) raw = raw.substr(0, hash);
    if (raw.find('\t') != absl::string_view::npos) return LineError(line, "tabs are not allowed; indent with spaces");
    absl::string_view content = absl::StripAsciiWhitespace(raw);
    if (content.empty()) continue;
    const bool item = absl::ConsumePrefix(&content, "- ");
    content = absl::StripLeadingAsciiWhitespace(content);
    const size_t colon = content.find(':');
    if (colon == absl::string_view::npos) return LineError(line, absl::StrCat("expected 'key: value', got '", content, "'"));
    const std::string key(absl::StripAsciiWhitespace(content.substr(0, colon)));
    const absl::string_view value = absl::StripAsciiWhitespace(content.substr(colon + 1));
    if (!saw_root) {
      if (key != "policies" || item || !value.empty()) return LineError(line, "expected 'policies:' first");
      saw_root = true;
      continue;
    }
    if (key == "policies") return LineError(line, "'policies:' appears twice");
    if (item && key == "name") {
      if (value.empty() || value.size() > 64 || !std::all_of(value.begin(), value.end(), IsNameChar)) {
        return LineError(line, absl::StrCat("name: '", value, "' must be 1 to 64 of [A-Za-z0-9_.-]"));
      }
      for (size_t i = 0; i < policies.size(); ++i) {
        if (policies[i].name == value) {
          return LineError(line, absl::StrCat("policy '", value, "' is defined twice (first on line ", policy_lines[i], ")"));
        }
      }
      if (policies.size() >= kMaxPolicies) return LineError(line, absl::StrCat("more than ", kMaxPolicies, " policies"));
      policies.push_back(Policy{std::string(value), {}});
      policy_lines.push_back(line);
      in_rules = false;
      continue;
    }
    if (policies.empty()) return LineError(line, "expected '- name: ...' to start a policy");
    Policy& policy = policies.back();
    if (!item && key == "rules") {
      if (!value.empty()) return LineError(line, "rules: the rules go on the lines below, each starting with '- '");
      if (in_rules) return LineError(line, absl::StrCat("policy '", policy.name, "' has 'rules:' twice"));
      in_rules = true;
      continue;
    }
    if (!in_rules) {
      return LineError(line, absl::StrCat("'", key, "' is not a policy key (name, rules)"));
    }
    if (item) {
      if (++n_rules > kMaxPolicyRules) return LineError(line, absl::StrCat("more than ", kMaxPolicyRules, " rules"));
      policy.rules.emplace_back();
      policy.rules.back().line = line;
      rule_keys.assign(1, {});
    } else if (policy.rules.empty()) {
      return LineError(line, absl::StrCat("'", key, "' before the first rule; start a rule with '- '"));
    }
    std::vector<std::string>& seen = rule_keys.back();
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      return LineError(line, absl::StrCat("'", key, "' given twice in one rule"));
    }
    seen.push_back(key);
    if (absl::Status s = SetRuleKey(key, value, line, &policy.rules.back()); !s.ok()) return s;
  }
  if (!saw_root) return absl::InvalidArgumentError("line 1: expected 'policies:' first (the text is empty)");
  if (policies.empty()) return LineError(line, "'policies:' lists no policy");
  for (size_t i = 0; i < policies.size(); ++i) {
    if (policies[i].rules.empty()) {
      return LineError(policy_lines[i], absl::StrCat("policy '", policies[i].name, "' has no rules"));
    }
    for (const PolicyRule& r : policies[i].rules) {
      if (r.formats.empty() == (r.max_rel_error == 0.0)) {
        return LineError(r.line, "a rule needs exactly one of formats and max_rel_error");
      }
    }
  }
  return policies;
}

}  // namespace kvpack::server
