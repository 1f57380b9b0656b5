#include "server/core/byte_size.h"

#include <cmath>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvpack::server {

absl::StatusOr<ByteSize> ParseByteSize(std::string_view text) {
  const std::string original(text);
  std::string s(text);
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat("byte size \"", original,
                                                   "\": expected e.g. 8589934592, 8G, 8Gi, 512Mi or a fraction 0.8"));
  };
  if (s.empty()) return bad();
  if (s.back() == 'B' || s.back() == 'b') s.pop_back();
  double multiplier = 1.0;
  bool binary = false;
  if (!s.empty() && s.back() == 'i') {
    binary = true;
    s.pop_back();
  }
  if (!s.empty() && std::isalpha(static_cast<unsigned char>(s.back()))) {
    const double base = binary ? 1024.0 : 1000.0;
    switch (s.back()) {
      case 'K': case 'k': multiplier = base; break;
      case 'M': case 'm': multiplier = base * base; break;
      case 'G': case 'g': multiplier = base * base * base; break;
      case 'T': case 't': multiplier = base * base * base * base; break;
      default: return bad();
    }
    s.pop_back();
  } else if (binary) {
    return bad();
  }
  double value = 0;
  if (s.empty() || !absl::SimpleAtod(s, &value) || !(value > 0) || !std::isfinite(value)) return bad();
  ByteSize out;
  if (multiplier == 1.0 && s.find('.') != std::string::npos && value <= 1.0) {
    out.is_fraction = true;
    out.fraction = value;
    return out;
  }
  out.bytes = static_cast<uint64_t>(std::llround(value * multiplier));
  return out;
}

}  // namespace kvpack::server
