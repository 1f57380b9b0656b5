// Reading a daemon's Prometheus text in tests (daemon_process.h's Metrics(), or an in-process
// Engine's metrics().Render()), and polling for a condition that the daemon reaches asynchronously.
#pragma once

#include <chrono>
#include <string>
#include <thread>

#include "tests/server/service/sanitizer_build.h"

namespace kvpack::testing {

// The value of one sample in Prometheus text format, e.g. Sample(text, "kvpack_pool_bytes{state=\"weights\"}").
inline double Sample(const std::string& text, const std::string& series) {
  size_t pos = 0;
  while ((pos = text.find(series, pos)) != std::string::npos) {
    const bool line_start = pos == 0 || text[pos - 1] == '\n';
    const size_t after = pos + series.size();
    if (line_start && after < text.size() && text[after] == ' ') return std::stod(text.substr(after + 1));
    pos = after;
  }
  return -1;  // no such series (a counter never incremented has none)
}

// Polls `pred` every 20 ms up to `timeout`.
template <typename Pred>
bool WaitFor(Pred pred,
             std::chrono::milliseconds timeout = std::chrono::milliseconds(10000 * kSanitizerSlowdown)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

}  // namespace kvpack::testing
