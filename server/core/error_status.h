// The one conversion from the kernels' Error to absl::Status (STYLE.md §8). Everything in server/
// that calls into kernels/ goes through it.
#pragma once

#include "absl/status/status.h"
#include "kernels/error.h"

namespace kvpack::server {

//   kInvalidArgument  → INVALID_ARGUMENT     kUnsupported → INVALID_ARGUMENT ("not supported: …")
//   kResourceExhausted→ RESOURCE_EXHAUSTED   kCancelled   → CANCELLED
//   kInternal         → INTERNAL (the backend marks itself unhealthy)
absl::Status ToStatus(const Error& error);

}  // namespace kvpack::server
