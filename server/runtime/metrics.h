// Prometheus metrics of kvpackd: exactly the families of docs/metrics.md.
//
// Gauges are not stored: a collectable reads them from `read_gauges` at scrape time (the pool,
// scheduler and registry snapshots), so /metrics and Status agree by construction. Counters and
// histograms are recorded as events happen.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/format.h"
#include "server/backends/backend.h"
#include "server/core/pool.h"
#include "server/runtime/metrics_http.h"

namespace prometheus {
class Counter;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace kvpack::server {

struct GaugeValues {
  uint64_t budget = 0;
  std::array<uint64_t, kNumPoolStates> by_state{};
  std::array<uint64_t, kNumPageFormats> by_format{};
  uint64_t high_water = 0;
  uint64_t mapped = 0;
  bool gpu_present = false;
  uint64_t gpu_free = 0;
  uint64_t gpu_total = 0;
  int queue_depth = 0;
  int shm_regions = 0;
  int cuda_ipc_regions = 0;
  int weights_handles = 0;
  int kv_handles = 0;
  uint64_t inline_held = 0;    // host bytes of inline tensors of calls in flight
  uint64_t inline_budget = 0;  // --max_inline_bytes_in_flight
  int lanes = 0;               // lanes open (the service's LaneTable, through Engine::SetLaneCount)
};

enum class Stage { kQueue, kProject, kAttend, kTransfer };

// Upper bounds of the kvpack_request_peak_bytes buckets: fractions of the budget, from 1/256 up in
// steps of at most 2x, and 1/16 of the budget apart above half of it, ending at the budget itself.
// No request holds more than the budget, so every quantile interpolated from these buckets lies at
// or below it (4x-apart buckets let the p90/p99 panels show peaks above the budget), and quantiles
// near the budget, where admission decisions are made, are resolved to 1/16 of it.
std::vector<double> PeakBuckets(uint64_t budget_bytes);

class Metrics {
 public:
  // `budget_bytes` places the kvpack_request_peak_bytes buckets (PeakBuckets).
  // `kernel` labels kvpack_device_info (which attention kernel serves, on which arch).
  Metrics(std::string version, std::string backend, KernelInfo kernel, uint64_t budget_bytes,
          std::function<GaugeValues()> read_gauges);
  ~Metrics();

  // Serves /metrics on `address` ("host:port"; port 0 picks one). Returns the bound port.
  absl::StatusOr<int> Serve(const std::string& address);

  void RecordRequest(const std::string& method, const char* code);
  void ObserveStage(Stage stage, double seconds);
  // A request's total wait for GPU turns (backends that TakesTurns()).
  void ObserveTurnWait(double seconds);
  void ObservePeakBytes(uint64_t bytes);
  void AddTokens(PageFormat format, uint64_t tokens);
  void AddDowngrades(uint64_t ranges);
  // One range of a run: the pre-pass's estimated relative error of the layer in the range's format.
  void ObserveEstimatedError(PageFormat format, double rel_error);
  // A block-sparse request's routed fraction (exact pages / visible pages).
  void ObserveRoutedFraction(double fraction);

  // The exposition text of every family (what GET /metrics answers).
  std::string Render() const;

 private:
  class GaugeCollectable;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<GaugeCollectable> gauges_;
  std::unique_ptr<MetricsHttpServer> http_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  std::array<prometheus::Histogram*, 4> stages_{};
  prometheus::Histogram* peak_ = nullptr;
  prometheus::Histogram* turn_wait_ = nullptr;
  std::array<prometheus::Counter*, kNumPageFormats> tokens_{};
  prometheus::Counter* downgrades_ = nullptr;
  std::array<prometheus::Histogram*, kNumPageFormats> estimated_error_{};
  prometheus::Histogram* routed_fraction_ = nullptr;
};

}  // namespace kvpack::server
