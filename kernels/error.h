// Errors of the kernels layer: a code and a message that names the offending field or value.
//
// Kernels and their host wrappers return these and never exit, abort or throw. The backends turn them
// into absl::Status exactly once (server/backend_status.h); nothing below server/ knows Abseil.
#pragma once

#include <string>
#include <utility>

namespace kvpack {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,     // a shape, range, option or tensor size is wrong; the message names it
  kUnsupported,         // valid in general but not on this backend (e.g. head_dim 256 on the GPU)
  kResourceExhausted,   // an allocation or workspace does not fit
  kCancelled,           // the caller asked to stop between chunks
  kInternal,            // a CUDA or cuBLASLt call failed; the message carries its text
};

class Error {
 public:
  Error() = default;
  Error(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Error Ok() { return Error(); }
  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

inline Error InvalidArgument(std::string message) { return Error(ErrorCode::kInvalidArgument, std::move(message)); }
inline Error Unsupported(std::string message) { return Error(ErrorCode::kUnsupported, std::move(message)); }

}  // namespace kvpack
