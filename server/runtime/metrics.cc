#include "server/runtime/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <exception>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvpack::server {

namespace {

prometheus::MetricFamily GaugeFamily(const std::string& name, const std::string& help) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = prometheus::MetricType::Gauge;
  return f;
}

void AddGauge(prometheus::MetricFamily* f, double value, std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  f->metric.push_back(std::move(m));
}

std::vector<double> Exponential(double start, double factor, int count) {
  std::vector<double> b;
  for (int i = 0; i < count; ++i, start *= factor) b.push_back(start);
  return b;
}

}  // namespace

class Metrics::GaugeCollectable final : public prometheus::Collectable {
 public:
  GaugeCollectable(std::string version, std::string backend, KernelInfo kernel, std::function<GaugeValues()> read)
      : version_(std::move(version)), backend_(std::move(backend)), kernel_(std::move(kernel)), read_(std::move(read)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const GaugeValues v = read_();
    std::vector<prometheus::MetricFamily> out;
    auto budget = GaugeFamily("kvpack_budget_bytes", "The hard --vram_budget ceiling on everything kvpackd allocates");
    AddGauge(&budget, static_cast<double>(v.budget));
    out.push_back(std::move(budget));
    auto pool = GaugeFamily("kvpack_pool_bytes", "Bytes allocated from the pool, by what holds them");
    for (int s = 0; s < kNumPoolStates; ++s) {
      AddGauge(&pool, static_cast<double>(v.by_state[s]), {{"state", PoolStateName(static_cast<PoolState>(s))}});
    }
    out.push_back(std::move(pool));
    auto fmt = GaugeFamily("kvpack_pool_format_bytes", "Packed K/V page bytes by format (active and kept)");
    for (int f = 0; f < kNumPageFormats; ++f) {
      AddGauge(&fmt, static_cast<double>(v.by_format[f]), {{"format", FormatName(static_cast<PageFormat>(f))}});
    }
    out.push_back(std::move(fmt));
    auto hw = GaugeFamily("kvpack_pool_high_water_bytes", "Highest pool total since start");
    AddGauge(&hw, static_cast<double>(v.high_water));
    out.push_back(std::move(hw));
    auto mapped = GaugeFamily("kvpack_pool_mapped_bytes", "Physical memory mapped behind the pool");
    AddGauge(&mapped, static_cast<double>(v.mapped));
    out.push_back(std::move(mapped));
    if (v.gpu_present) {
      auto gpu = GaugeFamily("kvpack_gpu_memory_bytes", "GPU memory from cudaMemGetInfo");
      AddGauge(&gpu, static_cast<double>(v.gpu_free), {{"kind", "free"}});
      AddGauge(&gpu, static_cast<double>(v.gpu_total), {{"kind", "total"}});
      out.push_back(std::move(gpu));
    }
    auto queue = GaugeFamily("kvpack_queue_depth", "Requests admitted-waiting for memory or the executor");
    AddGauge(&queue, v.queue_depth);
    out.push_back(std::move(queue));
    auto regions = GaugeFamily("kvpack_regions", "Registered memory regions");
    AddGauge(&regions, v.shm_regions, {{"kind", "shm"}});
    AddGauge(&regions, v.cuda_ipc_regions, {{"kind", "cuda_ipc"}});
    out.push_back(std::move(regions));
    auto handles = GaugeFamily("kvpack_handles", "Live weight and K/V handles");
    AddGauge(&handles, v.weights_handles, {{"kind", "weights"}});
    AddGauge(&handles, v.kv_handles, {{"kind", "kv"}});
    out.push_back(std::move(handles));
    auto inline_bytes = GaugeFamily("kvpack_inline_bytes",
                                    "Host bytes of inline tensors held by calls in flight (outside the pool)");
    AddGauge(&inline_bytes, static_cast<double>(v.inline_held));
    out.push_back(std::move(inline_bytes));
    auto inline_budget = GaugeFamily("kvpack_inline_budget_bytes",
                                     "The --max_inline_bytes_in_flight ceiling on kvpack_inline_bytes");
    AddGauge(&inline_budget, static_cast<double>(v.inline_budget));
    out.push_back(std::move(inline_budget));
    auto lanes = GaugeFamily("kvpack_lanes", "Lanes open (same-host calls through shared memory; each a thread)");
    AddGauge(&lanes, v.lanes);
    out.push_back(std::move(lanes));
    auto info = GaugeFamily("kvpack_build_info", "Which build and backend serve");
    AddGauge(&info, 1.0, {{"backend", backend_}, {"version", version_}});
    out.push_back(std::move(info));
    auto device = GaugeFamily("kvpack_device_info", "Which attention kernel serves, on which GPU arch (Status fields 32-35)");
    AddGauge(&device, 1.0,
             {{"archs", kernel_.cuda_archs_built},
              {"attention_kernel", kernel_.attention_kernel},
              {"compute_capability", kernel_.compute_capability},
              {"sm_count", std::to_string(kernel_.sm_count)}});
    out.push_back(std::move(device));
    return out;
  }

 private:
  const std::string version_, backend_;
  const KernelInfo kernel_;
  const std::function<GaugeValues()> read_;
};

std::vector<double> PeakBuckets(uint64_t budget_bytes) {
  if (budget_bytes == 0) return Exponential(65536.0, 2.0, 28);  // no budget known: 64 KiB .. 8 TiB
  const double budget = static_cast<double>(budget_bytes);
  std::vector<double> b;
  for (double f = 1.0 / 256; f < 0.5; f *= 2) b.push_back(f * budget);
  for (int sixteenths = 8; sixteenths <= 16; ++sixteenths) b.push_back(sixteenths / 16.0 * budget);
  return b;
}

Metrics::Metrics(std::string version, std::string backend, KernelInfo kernel, uint64_t budget_bytes,
                 std::function<GaugeValues()> read_gauges)
    : registry_(std::make_shared<prometheus::Registry>()),
      gauges_(std::make_shared<GaugeCollectable>(std::move(version), std::move(backend), std::move(kernel),
                                                 std::move(read_gauges))) {
  requests_ = &prometheus::BuildCounter().Name("kvpack_requests_total").Help("Finished RPCs").Register(*registry_);
  auto& stages = prometheus::BuildHistogram()
                     .Name("kvpack_stage_duration_seconds")
                     .Help("Time per request stage")
                     .Register(*registry_);
  const std::vector<double> seconds = Exponential(0.0005, 2.0, 18);  // 0.5 ms .. ~65 s
  const char* names[] = {"queue", "project", "attend", "transfer"};
  for (int i = 0; i < 4; ++i) stages_[i] = &stages.Add({{"stage", names[i]}}, seconds);
  turn_wait_ = &prometheus::BuildHistogram()
                    .Name("kvpack_gpu_turn_wait_seconds")
                    .Help("Time a request waited for GPU turns while other requests' chunks ran")
                    .Register(*registry_)
                    .Add({}, seconds);
  auto& peak = prometheus::BuildHistogram()
                   .Name("kvpack_request_peak_bytes")
                   .Help("Peak pool bytes a request held")
                   .Register(*registry_);
  peak_ = &peak.Add({}, PeakBuckets(budget_bytes));
  auto& tokens = prometheus::BuildCounter().Name("kvpack_tokens_total").Help("Tokens packed, by format").Register(*registry_);
  for (int f = 0; f < kNumPageFormats; ++f) tokens_[f] = &tokens.Add({{"format", FormatName(static_cast<PageFormat>(f))}});
  downgrades_ = &prometheus::BuildCounter()
                     .Name("kvpack_precision_downgrades_total")
                     .Help("Ranges stored below their first allowed format to fit the budget")
                     .Register(*registry_)
                     .Add({});
  auto& estimated = prometheus::BuildHistogram()
                        .Name("kvpack_estimated_relative_error")
                        .Help("Estimated relative L2 error of a layer's output in each range's format, per range run")
                        .Register(*registry_);
  const std::vector<double> errors = Exponential(1e-4, 2.0, 14);  // 1e-4 .. ~0.8
  for (int f = 0; f < kNumPageFormats; ++f) {
    estimated_error_[f] = &estimated.Add({{"format", FormatName(static_cast<PageFormat>(f))}}, errors);
  }
  std::vector<double> fractions;  // 0.05 .. 1 in steps of 0.05
  for (int i = 1; i <= 20; ++i) fractions.push_back(0.05 * i);
  routed_fraction_ = &prometheus::BuildHistogram()
                          .Name("kvpack_sparse_routed_fraction")
                          .Help("Per block-sparse request, the fraction of visible key pages attended exactly")
                          .Register(*registry_)
                          .Add({}, fractions);
}

Metrics::~Metrics() = default;

absl::StatusOr<int> Metrics::Serve(const std::string& address) {
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start(address, [this] { return Render(); });
  if (!server.ok()) return server.status();
  http_ = std::move(*server);
  return http_->port();
}

std::string Metrics::Render() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& f : gauges_->Collect()) families.push_back(std::move(f));
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

void Metrics::RecordRequest(const std::string& method, const char* code) {
  requests_->Add({{"method", method}, {"code", code}}).Increment();
}

void Metrics::ObserveStage(Stage stage, double seconds) { stages_[static_cast<int>(stage)]->Observe(seconds); }
void Metrics::ObserveTurnWait(double seconds) { turn_wait_->Observe(seconds); }
void Metrics::ObservePeakBytes(uint64_t bytes) { peak_->Observe(static_cast<double>(bytes)); }
void Metrics::AddTokens(PageFormat format, uint64_t tokens) {
  tokens_[static_cast<int>(format)]->Increment(static_cast<double>(tokens));
}
void Metrics::AddDowngrades(uint64_t ranges) { downgrades_->Increment(static_cast<double>(ranges)); }
void Metrics::ObserveEstimatedError(PageFormat format, double rel_error) {
  estimated_error_[static_cast<int>(format)]->Observe(rel_error);
}
void Metrics::ObserveRoutedFraction(double fraction) { routed_fraction_->Observe(fraction); }

}  // namespace kvpack::server
