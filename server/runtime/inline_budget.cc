#include "server/runtime/inline_budget.h"

#include "absl/strings/str_cat.h"

namespace kvpack::server {

InlineBudget::Lease& InlineBudget::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = other.budget_;
    bytes_ = other.bytes_;
    other.budget_ = nullptr;
  }
  return *this;
}

void InlineBudget::Lease::Release() {
  if (budget_ == nullptr) return;
  budget_->held_.fetch_sub(bytes_, std::memory_order_relaxed);
  budget_ = nullptr;
}

absl::StatusOr<InlineBudget::Lease> InlineBudget::Acquire(uint64_t bytes) {
  uint64_t held = held_.load(std::memory_order_relaxed);
  do {
    if (bytes > max_ || held > max_ - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "inline tensors of ", bytes, " bytes: ", held, " of this daemon's ", max_,
          " bytes for inline tensors in flight (--max_inline_bytes_in_flight) are held by other calls; "
          "retry later or use a region"));
    }
  } while (!held_.compare_exchange_weak(held, held + bytes, std::memory_order_relaxed));
  return Lease(this, bytes);
}

}  // namespace kvpack::server
