// The one mapping from absl::Status to gRPC status (STYLE.md §8), and gRPC code names for metrics.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvpack::server {

grpc::Status ToGrpcStatus(const absl::Status& status);
// "OK", "INVALID_ARGUMENT", ... (the `code` label of kvpack_requests_total).
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace kvpack::server
