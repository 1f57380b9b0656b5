#include "server/core/error_status.h"

namespace kvpack::server {

absl::Status ToStatus(const Error& error) {
  switch (error.code()) {
    case ErrorCode::kOk: return absl::OkStatus();
    case ErrorCode::kInvalidArgument: return absl::InvalidArgumentError(error.message());
    case ErrorCode::kUnsupported: return absl::InvalidArgumentError("not supported: " + error.message());
    case ErrorCode::kResourceExhausted: return absl::ResourceExhaustedError(error.message());
    case ErrorCode::kCancelled: return absl::CancelledError(error.message());
    case ErrorCode::kInternal: return absl::InternalError(error.message());
  }
  return absl::UnknownError(error.message());
}

}  // namespace kvpack::server
