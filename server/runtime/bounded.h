// Client strings echoed in error messages are cut to a bounded length: a status message must not
// copy a 1 MiB handle back to the client (and into logs).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvpack::server {

// Characters of a client string that an error message repeats; longer ones end in "…".
inline constexpr size_t kMaxEchoedChars = 64;

// `s` cut to kMaxEchoedChars bytes plus "…" (UTF-8) when longer; the cut never splits a UTF-8
// sequence.
inline std::string Bounded(std::string_view s) {
  if (s.size() <= kMaxEchoedChars) return std::string(s);
  size_t n = kMaxEchoedChars;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // s[n] continues a sequence
  return std::string(s.substr(0, n)) + "\u2026";
}

}  // namespace kvpack::server
