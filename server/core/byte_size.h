// Parsing of byte sizes on the command line: "17179869184", "16G", "16Gi", "512Mi", "1.5G", or a
// fraction of free device memory ("0.8").
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvpack::server {

struct ByteSize {
  uint64_t bytes = 0;     // when !is_fraction
  double fraction = 0.0;  // in (0, 1] when is_fraction
  bool is_fraction = false;
  uint64_t Resolve(uint64_t free_bytes) const {
    return is_fraction ? static_cast<uint64_t>(fraction * static_cast<double>(free_bytes)) : bytes;
  }
};

// Suffixes K M G T (powers of 1000) and Ki Mi Gi Ti (powers of 1024), optional trailing "B".
// A plain number below or equal to 1 with a decimal point is a fraction.
absl::StatusOr<ByteSize> ParseByteSize(std::string_view text);

}  // namespace kvpack::server
