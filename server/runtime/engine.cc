#include "server/runtime/engine.h"

#include <new>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/transform_choice.h"
#include "server/backends/faulty_backend.h"

namespace kvpack::server {
namespace {

constexpr absl::Duration kTrimAfterIdle = absl::Seconds(1);

// The error estimate the pre-pass left in the entry `kv` (its head_estimates table, 16 bytes per
// head: one small copy from the pool).
absl::Status ReadEstimateOf(Backend& backend, const LayerConfig& config, const uint8_t* kv, ErrorEstimate* out) {
  const KvLayout layout = PlanKvTables(config.shape, config.ranges);
  std::vector<float> table(static_cast<size_t>(config.shape.n_heads) * kHeadEstimateFields);
  if (absl::Status s = backend.CopyFromPool(table.data(), kv + layout.head_estimates_offset,
                                            table.size() * sizeof(float));
      !s.ok()) {
    return s;
  }
  *out = ErrorEstimate{};
  for (int f = 0; f < kNumPageFormats; ++f) {
    out->rel_error[f] = EstimatedRelError(table.data(), config.shape.n_heads, static_cast<PageFormat>(f));
    out->present = out->present || out->rel_error[f] > 0.0;
  }
  return absl::OkStatus();
}

}  // namespace

std::array<uint64_t, kNumPageFormats> KvFormatBytes(const LayerConfig& config) {
  std::array<uint64_t, kNumPageFormats> out{};
  const uint64_t heads_kv = 2ull * static_cast<uint64_t>(config.shape.n_heads);
  for (const TokenRange& r : config.ranges) {
    const uint64_t pages = static_cast<uint64_t>((r.end - r.begin + kPageTokens - 1) / kPageTokens);
    out[static_cast<int>(r.format)] += pages * heads_kv * PageBytes(r.format, config.shape.head_dim);
  }
  return out;
}

namespace {

// The backend's arena; with fault injection, one whose allocations fail on demand (host memory on a
// backend that reads it, else the device's VMM mappings).
std::unique_ptr<Arena> ArenaOf(Backend& backend, FaultInjector* faults) {
  std::unique_ptr<Arena> arena = backend.CreateArena();
  if (faults == nullptr) return arena;
  return WithFaults(std::move(arena), faults, backend.ReadsHostMemory() ? FaultSite::kHostAlloc : FaultSite::kVmmMap);
}

}  // namespace

Engine::Engine(EngineOptions options, std::unique_ptr<Backend> backend, const Clock* clock)
    : options_(std::move(options)),
      clock_(clock),
      backend_(options_.faults ? WithDeviceFaults(std::move(backend), options_.faults) : std::move(backend)),
      pool_(std::make_unique<Pool>(options_.budget_bytes, ArenaOf(*backend_, options_.faults))),
      registry_(clock, options_.lease, options_.registry),
      inline_budget_(options_.max_inline_bytes_in_flight) {
  scheduler_ = std::make_unique<Scheduler>(options_.scheduler, pool_.get(), clock_);
  if (backend_->TakesTurns()) {
    turns_ = std::make_unique<TurnArbiter>(options_.turns, clock_);
    // A call alone on the device may queue its next chunk before the previous one ends (backend.h).
    backend_->SetRunsAlone([turns = turns_.get()] { return turns->Participants() <= 1; });
  }
  metrics_ = std::make_unique<Metrics>(options_.version, backend_->name(), backend_->Kernel(), options_.budget_bytes,
                                       [this] { return Gauges(); });
  pool_->SetReleaseListener([this] { scheduler_->Pump(); });
  executor_ = std::make_unique<Executor>(options_.executor_threads, options_.executor_nice);
  RefreshDeviceMemory();
}

Engine::~Engine() {
  Drain();
  executor_.reset();
  pool_->SetReleaseListener(nullptr);
  registry_.Clear();
}

PlannerCosts Engine::Costs() const {
  PlannerCosts costs;
  Backend* b = backend_.get();
  costs.supported = [b](const LayerConfig& c) { return b->Supported(c); };
  costs.kv_bytes = [b](const LayerConfig& c) { return b->KvBytes(c); };
  costs.workspace_bytes = [b](const LayerConfig& c) { return b->WorkspaceBytes(c); };
  costs.io_bytes = [b](const LayerConfig& c, const TensorResidency& r) { return b->IoBytes(c, r); };
  costs.routing_bytes = [b](const LayerConfig& c) { return b->RoutingBytes(c); };
  return costs;
}

uint64_t Engine::CapacityFor(const std::string& tenant) const {
  const PoolSnapshot s = pool_->Snapshot();
  const uint64_t held = s.by_state[static_cast<int>(PoolState::kWeights)] + s.by_state[static_cast<int>(PoolState::kKvKept)];
  uint64_t capacity = s.budget > held ? s.budget - held : 0;
  if (options_.tenant_quota_bytes > 0) {
    auto it = s.by_tenant.find(tenant);
    const uint64_t used = it == s.by_tenant.end() ? 0 : it->second;
    const uint64_t left = options_.tenant_quota_bytes > used ? options_.tenant_quota_bytes - used : 0;
    capacity = std::min(capacity, left);
  }
  return capacity;
}

absl::Status Engine::CheckQuota(const std::string& tenant, uint64_t bytes) const {
  if (options_.tenant_quota_bytes == 0) return absl::OkStatus();
  const PoolSnapshot s = pool_->Snapshot();
  auto it = s.by_tenant.find(tenant);
  const uint64_t used = it == s.by_tenant.end() ? 0 : it->second;
  if (used + PoolBytes(bytes) > options_.tenant_quota_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant \"", tenant, "\" holds ", used, " bytes; ",
                                                     PoolBytes(bytes), " more would pass its quota of ",
                                                     options_.tenant_quota_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerPlan> Engine::Plan(const std::string& tenant, const LayerRequest& request,
                                       const KvEntry* kv) const {
  const uint64_t capacity = CapacityFor(tenant);
  LayerRequest fixed = request;
  fixed.max_chunk = options_.max_chunk_tokens;
  if (kv == nullptr) return PlanLayer(fixed, capacity, Costs());
  // Attend: the entry fixes the formats, and its bytes are already held.
  for (size_t i = 0; i < fixed.ranges.size() && i < kv->config.ranges.size(); ++i) {
    fixed.ranges[i].allowed = {kv->config.ranges[i].format};
  }
  PlannerCosts costs = Costs();
  costs.kv_bytes = [](const LayerConfig&) { return uint64_t{0}; };
  return PlanLayer(fixed, capacity, costs);
}

void Engine::Submit(std::shared_ptr<LayerJob> job) {
  job->submitted = clock_->Now();
  Job sj;
  sj.tenant = job->tenant;
  sj.priority = job->priority;
  sj.peak_bytes = job->plan.peak_bytes;
  sj.deadline = job->deadline;
  if (options_.tenant_quota_bytes > 0) {
    const std::string tenant = job->tenant;
    const uint64_t peak = job->plan.peak_bytes;
    sj.try_claim = [this, tenant, peak] { return TryClaim(tenant, peak); };
    sj.unclaim = [this, tenant, peak] { Unclaim(tenant, peak); };
  }
  sj.on_admit = [this, job](Pool::Reservation reservation) {
    auto shared = std::make_shared<Pool::Reservation>(std::move(reservation));
    {
      // Posted under mu_, so Run (which takes mu_ first) always finds its posted_ entry to erase.
      // The reservation lives in the task: withdrawing the task frees it.
      std::lock_guard<std::mutex> lock(mu_);
      ++running_[job->tenant];
      ++running_total_;
      const uint64_t task = executor_->Post([this, job, shared] { Run(job, std::move(*shared)); });
      job->task = task;
      posted_[task] = job;
    }
    // Cancel() or Drain() may have run before the task id was set.
    if (job->cancelled) Withdraw(job, absl::CancelledError("cancelled while waiting for an executor thread"));
    if (draining_) Withdraw(job, absl::UnavailableError("kvpackd is shutting down; the request had not started"));
  };
  sj.on_reject = [job](absl::Status status) { job->done(std::move(status)); };
  if (draining_) {
    job->done(absl::UnavailableError("kvpackd is shutting down"));
    return;
  }
  absl::StatusOr<uint64_t> ticket = scheduler_->Submit(std::move(sj));
  if (!ticket.ok()) {
    job->done(ticket.status());
    return;
  }
  job->ticket = *ticket;
}

bool Engine::TryClaim(const std::string& tenant, uint64_t bytes) {
  const PoolSnapshot s = pool_->Snapshot();
  auto it = s.by_tenant.find(tenant);
  const uint64_t held = it == s.by_tenant.end() ? 0 : it->second;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t& claimed = claimed_[tenant];
  if (held + claimed + bytes > options_.tenant_quota_bytes && claimed > 0) return false;  // alone, it may run
  claimed += bytes;
  return true;
}

void Engine::Unclaim(const std::string& tenant, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = claimed_.find(tenant);
  if (it == claimed_.end()) return;
  it->second -= bytes;
  if (it->second == 0) claimed_.erase(it);
}

void Engine::Cancel(const std::shared_ptr<LayerJob>& job) {
  job->cancelled = true;
  if (job->ticket != 0) scheduler_->Cancel(job->ticket);
  Withdraw(job, absl::CancelledError("cancelled while waiting for an executor thread"));
  if (turns_ && job->turn != 0) turns_->Cancel(job->turn);
}

bool Engine::Withdraw(const std::shared_ptr<LayerJob>& job, absl::Status status) {
  const uint64_t task = job->task;
  if (task == 0 || !executor_->Withdraw(task)) return false;  // destroys the task, so its reservation
  {
    std::lock_guard<std::mutex> lock(mu_);
    posted_.erase(task);
  }
  Retire(*job);
  job->done(std::move(status));
  return true;
}

void Engine::Retire(const LayerJob& job) {
  if (options_.tenant_quota_bytes > 0) Unclaim(job.tenant, job.plan.peak_bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (--running_[job.tenant] == 0) running_.erase(job.tenant);
  --running_total_;
  last_finished_ = clock_->Now();
}

void Engine::RefreshDeviceMemory() {
  const DeviceMemory dm = backend_->QueryDeviceMemory();  // outside device_mu_: it may be slow
  std::lock_guard<std::mutex> lock(device_mu_);
  device_memory_ = dm;
}

void Engine::Tick() {
  RefreshDeviceMemory();
  scheduler_->Pump();
  registry_.Reap();
  // Idle physical memory goes back to the device only after a second without requests: a frontend
  // calling layer after layer keeps its chunks mapped (mapping costs ~0.1 ms per 2 MiB chunk).
  const absl::Time now = clock_->Now();
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = running_total_ == 0 && now - last_finished_ >= kTrimAfterIdle;
  }
  if (idle && scheduler_->QueueDepth() == 0) pool_->Trim();
}

void Engine::RejectQueued() {
  // Queued work is rejected, not run: see docs/daemon.md ("Shutdown") for why.
  draining_ = true;
  scheduler_->RejectAll(absl::UnavailableError("kvpackd is shutting down; the request had not started"));
  std::vector<std::shared_ptr<LayerJob>> posted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [task, job] : posted_) posted.push_back(job);
  }
  for (const std::shared_ptr<LayerJob>& job : posted) {
    Withdraw(job, absl::UnavailableError("kvpackd is shutting down; the request had not started"));
  }
}

void Engine::Drain() {
  RejectQueued();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (running_total_ == 0) return;  // every admitted job retired (ran or withdrawn)
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Admitted jobs that an executor thread has started; those still waiting for one are in the
// executor's queue (queue_depth), and SIGTERM rejects them.
int Engine::Running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_total_ - static_cast<int>(posted_.size());
}

std::map<std::string, int> Engine::RunningByTenant() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, int> out = running_;
  for (const auto& [task, job] : posted_) {
    if (auto it = out.find(job->tenant); it != out.end() && --it->second == 0) out.erase(it);
  }
  return out;
}

void Engine::SetLaneCount(std::function<int()> count) {
  std::lock_guard<std::mutex> lock(lane_count_mu_);
  lane_count_ = std::move(count);
}

GaugeValues Engine::Gauges() const {
  const PoolSnapshot s = pool_->Snapshot();
  GaugeValues v;
  v.budget = s.budget;
  v.by_state = s.by_state;
  v.by_format = s.by_format;
  v.high_water = s.high_water;
  v.mapped = s.mapped;
  DeviceMemory dm;
  {
    std::lock_guard<std::mutex> lock(device_mu_);
    dm = device_memory_;
  }
  v.gpu_present = dm.present;
  v.gpu_free = dm.free_bytes;
  v.gpu_total = dm.total_bytes;
  v.queue_depth = static_cast<int>(scheduler_->QueueDepth()) + executor_->Pending();
  const RegistryCounts c = registry_.Counts();
  v.shm_regions = c.shm;
  v.cuda_ipc_regions = c.cuda_ipc;
  v.weights_handles = c.weights;
  v.kv_handles = c.kv;
  v.inline_held = inline_budget_.held();
  v.inline_budget = inline_budget_.max();
  {
    std::lock_guard<std::mutex> lock(lane_count_mu_);
    v.lanes = lane_count_ ? lane_count_() : 0;
  }
  return v;
}

void Engine::Run(const std::shared_ptr<LayerJob>& job, Pool::Reservation reservation) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    posted_.erase(job->task);
  }
  absl::Status status;
  try {
    status = RunLocked(*job, reservation);
  } catch (const std::bad_alloc&) {  // host memory of the backend (e.g. a CPU layer's vectors)
    status = absl::ResourceExhaustedError("the daemon ran out of host memory while running the layer");
  }
  if (turns_) {
    turns_->Leave(job->turn);  // ignored when it never joined (it ended before, or had no turns)
    metrics_->ObserveTurnWait(job->turn_wait_seconds);
  }
  reservation.Release();
  Retire(*job);
  if (job->replied) {  // answered OK after the launches (done_event); the call may be gone by now
    if (!status.ok()) {
      std::fprintf(stderr, "kvpackd: a %s call answered before its kernels finished then failed: %s\n",
                   job->method.c_str(), std::string(status.message()).c_str());
    }
    return;
  }
  job->done(std::move(status));
}

// Device copies of the tensors a GPU backend cannot read where they are: inline uploads and
// shared-memory regions (host memory). Tensors in CUDA IPC regions are used in place, copying
// nothing. The copies come from the request's reservation (the plan's io bytes); with an output
// that is not on the device, *host_out says where RunLocked copies it back.
absl::Status Engine::StageOnDevice(LayerJob& job, Pool::Reservation& reservation, LayerTensors* tensors,
                                   Pool::Lease* io, uint16_t** host_out) {
  const LayerConfig& config = job.plan.config;
  const bool projected = config.projected.enabled;
  const uint64_t x_bytes = projected ? 0 : 2ull * config.shape.n_tokens * config.shape.hidden;
  const uint64_t qkv_bytes = projected ? 2ull * static_cast<uint64_t>(config.projected.SpanElements(config.shape)) : 0;
  const uint16_t** qkv[3] = {&tensors->q, &tensors->k, &tensors->v};
  const bool stage_qkv[3] = {projected && !job.resident.q, projected && !job.resident.k, projected && !job.resident.v};
  const uint64_t positions_bytes =
      tensors->positions != nullptr ? 4ull * config.shape.n_tokens * config.rope.n_axes : 0;
  const uint64_t out_bytes = 2ull * config.shape.n_tokens * config.shape.HeadCols();
  const bool writes_out = job.mode != LayerMode::kProject;
  const bool stage_x = !projected && !job.resident.x;
  const bool stage_positions = positions_bytes > 0 && !job.resident.positions;
  const bool stage_out = writes_out && !config.in_place && !job.resident.out;
  uint64_t bytes = (stage_x ? PoolBytes(x_bytes) : 0) + (stage_positions ? PoolBytes(positions_bytes) : 0) +
                   (stage_out ? PoolBytes(out_bytes) : 0);
  for (bool stage : stage_qkv) bytes += stage ? PoolBytes(qkv_bytes) : 0;
  if (bytes == 0) return absl::OkStatus();
  absl::StatusOr<Pool::Lease> lease = pool_->Allocate({bytes, PoolState::kWorkspace, job.tenant, {}}, &reservation);
  if (!lease.ok()) return lease.status();
  *io = std::move(*lease);
  uint8_t* at = io->data();
  if (stage_x) {
    if (absl::Status s = backend_->CopyToPool(at, tensors->x, x_bytes); !s.ok()) return s;
    if (writes_out && config.in_place) {
      *host_out = tensors->out;  // == the host x
      tensors->out = reinterpret_cast<uint16_t*>(at);
    }
    tensors->x = reinterpret_cast<const uint16_t*>(at);
    at += PoolBytes(x_bytes);
  }
  for (int i = 0; i < 3; ++i) {  // q, k, v: whole spans, so the strides stay as the caller gave them
    if (!stage_qkv[i]) continue;
    if (absl::Status s = backend_->CopyToPool(at, *qkv[i], qkv_bytes); !s.ok()) return s;
    *qkv[i] = reinterpret_cast<const uint16_t*>(at);
    at += PoolBytes(qkv_bytes);
  }
  if (stage_positions) {
    if (absl::Status s = backend_->CopyToPool(at, tensors->positions, positions_bytes); !s.ok()) return s;
    tensors->positions = reinterpret_cast<const float*>(at);
    at += PoolBytes(positions_bytes);
  }
  if (stage_out) {
    *host_out = tensors->out;
    tensors->out = reinterpret_cast<uint16_t*>(at);
  }
  return absl::OkStatus();
}

ChunkGate Engine::GateOf(LayerJob& job) {
  return [&job, this]() -> Error {
    if (job.cancelled) return Error(ErrorCode::kCancelled, "cancelled between chunks");
    if (clock_->Now() >= job.deadline) return Error(ErrorCode::kCancelled, "deadline passed between chunks");
    if (!turns_) return Error::Ok();
    const absl::Time t0 = clock_->Now();
    const absl::Status turn = turns_->Acquire(job.turn);
    job.turn_wait_seconds += absl::ToDoubleSeconds(clock_->Now() - t0);
    if (!turn.ok()) return Error(ErrorCode::kCancelled, std::string(turn.message()));
    return Error::Ok();
  };
}

// The caller's work that writes the job's CUDA IPC inputs (header.cuda_wait_event), waited for
// before the first launch that reads them (after the host-side preparation); the wait counts as
// queue time.
absl::Status Engine::WaitForCaller(LayerJob& job) {
  if (job.wait_event.empty()) return absl::OkStatus();
  const absl::Time t0 = clock_->Now();
  absl::Status s = backend_->WaitIpcEvent(job.wait_event, job.deadline);
  job.queue_seconds += absl::ToDoubleSeconds(clock_->Now() - t0);
  return s;
}

absl::Status Engine::RunLocked(LayerJob& job, Pool::Reservation& reservation) {
  const absl::Time start = clock_->Now();
  job.queue_seconds = absl::ToDoubleSeconds(start - job.submitted);
  metrics_->ObserveStage(Stage::kQueue, job.queue_seconds);
  if (job.cancelled || start >= job.deadline) {
    return job.cancelled ? absl::CancelledError("cancelled before it ran")
                         : absl::DeadlineExceededError("deadline passed before it ran");
  }
  const ChunkGate gate = GateOf(job);
  const LayerConfig& config = job.plan.config;

  // Weights live in the pool (none with pre-projected input).
  LayerTensors tensors = job.tensors;
  if (job.weights != nullptr) {
    const WeightsEntry& w = *job.weights;
    const uint8_t* wbase = w.lease.data();
    tensors.w_qkv = reinterpret_cast<const uint16_t*>(wbase);
    tensors.bias = w.has_bias ? reinterpret_cast<const float*>(wbase + w.bias_offset()) : nullptr;
    tensors.q_norm_weight = w.norm_len > 0 ? reinterpret_cast<const float*>(wbase + w.q_norm_offset()) : nullptr;
    tensors.k_norm_weight = w.norm_len > 0 ? reinterpret_cast<const float*>(wbase + w.k_norm_offset()) : nullptr;
  }
  Pool::Lease io_lease;
  uint16_t* host_out = nullptr;  // where a staged output goes back to
  if (!backend_->ReadsHostMemory()) {
    const absl::Time t0 = clock_->Now();
    if (absl::Status s = StageOnDevice(job, reservation, &tensors, &io_lease, &host_out); !s.ok()) return s;
    job.transfer_seconds += absl::ToDoubleSeconds(clock_->Now() - t0);
  }

  // Memory, all from the reservation (the plan's peak).
  const absl::Time allocate_start = clock_->Now();
  Pool::Lease kv_lease;
  const uint8_t* kv = nullptr;
  if (job.mode == LayerMode::kAttend) {
    kv = job.kv_in->lease.data();
  } else {
    AllocationSpec spec{job.plan.kv_bytes, PoolState::kKvActive, job.tenant, KvFormatBytes(config)};
    absl::StatusOr<Pool::Lease> lease = pool_->Allocate(spec, &reservation);
    if (!lease.ok()) return lease.status();
    kv_lease = std::move(*lease);
    kv = kv_lease.data();
  }
  Pool::Lease ws_lease;
  if (job.plan.workspace_bytes > 0) {
    absl::StatusOr<Pool::Lease> lease =
        pool_->Allocate({job.plan.workspace_bytes, PoolState::kWorkspace, job.tenant, {}}, &reservation);
    if (!lease.ok()) return lease.status();
    ws_lease = std::move(*lease);
  }
  job.peak_bytes = kv_lease.bytes() + ws_lease.bytes() + io_lease.bytes();
  job.allocate_seconds = absl::ToDoubleSeconds(clock_->Now() - allocate_start);
  // Only now the caller's event: staging host tensors and taking (mapping) the memory need none of
  // the caller's GPU work, so they overlap it instead of leaving the GPU idle after it.
  if (absl::Status s = WaitForCaller(job); !s.ok()) return s;
  // It joins the GPU turns only now: before its caller's work has finished it cannot use the GPU,
  // so until then it keeps no other call from running ahead of its chunks (backend.h).
  if (turns_) {
    job.turn = turns_->Join(job.tenant, job.priority);
    if (job.cancelled) turns_->Cancel(job.turn);  // Cancel() may have run before the id was set
  }

  if (job.mode != LayerMode::kAttend) {
    const absl::Time t0 = clock_->Now();
    absl::Status s = backend_->ProjectKv(config, tensors, kv_lease.data(), ws_lease.data(), gate);
    if (turns_) turns_->Release(job.turn);  // the turn is not held across host work between calls
    if (!s.ok()) return s;
    job.project_seconds = absl::ToDoubleSeconds(clock_->Now() - t0);
    metrics_->ObserveStage(Stage::kProject, job.project_seconds);
    for (const TokenRange& r : config.ranges) metrics_->AddTokens(r.format, static_cast<uint64_t>(r.end - r.begin));
    if (absl::Status s = ReadEstimateOf(*backend_, config, kv_lease.data(), &job.estimate); !s.ok()) return s;
    if (job.estimate.present) {
      for (const TokenRange& r : config.ranges) {
        metrics_->ObserveEstimatedError(r.format, job.estimate.rel_error[static_cast<int>(r.format)]);
      }
    }
    if (job.plan.downgrades > 0) metrics_->AddDowngrades(static_cast<uint64_t>(job.plan.downgrades));
  }
  if (job.mode != LayerMode::kProject) {
    const absl::Time t0 = clock_->Now();
    absl::Status s;
    if (job.done_event.empty()) {
      s = backend_->AttendLayer(config, tensors, kv, ws_lease.data(), gate, &job.sparse_report);
    } else {
      // The caller hears back once the last kernel is queued behind its event; this thread still
      // waits for the kernels before anything below releases the call's memory (backend.h).
      const auto launched = [&] {
        job.attend_seconds = absl::ToDoubleSeconds(clock_->Now() - t0);  // the launches, in the result
        job.replied = true;
        job.done(absl::OkStatus());
      };
      s = backend_->AttendLayerSignalled(config, tensors, kv, ws_lease.data(), gate, job.done_event, launched,
                                         &job.sparse_report);
    }
    if (turns_) turns_->Release(job.turn);
    if (!s.ok()) return s;
    job.attend_seconds = absl::ToDoubleSeconds(clock_->Now() - t0);
    metrics_->ObserveStage(Stage::kAttend, job.attend_seconds);
    if (config.attention.sparse.enabled) metrics_->ObserveRoutedFraction(job.sparse_report.RoutedFraction());
  }
  if (host_out != nullptr) {
    const absl::Time t0 = clock_->Now();
    const uint64_t out_bytes = 2ull * config.shape.n_tokens * config.shape.HeadCols();
    if (absl::Status s = backend_->CopyFromPool(host_out, tensors.out, out_bytes); !s.ok()) return s;
    job.transfer_seconds += absl::ToDoubleSeconds(clock_->Now() - t0);
  }
  if (io_lease.bytes() > 0) metrics_->ObserveStage(Stage::kTransfer, job.transfer_seconds);
  metrics_->ObservePeakBytes(job.peak_bytes);
  const absl::Time release_start = clock_->Now();
  ws_lease.Release();
  io_lease.Release();

  if (job.keep_kv || job.mode == LayerMode::kProject) {
    kv_lease.SetState(PoolState::kKvKept);
    auto entry = std::make_shared<KvEntry>();
    entry->id = Registry::NewId("kv-");
    entry->tenant = job.tenant;
    entry->weights_id = job.weights != nullptr ? job.weights->id : "";  // "": from pre-projected input
    entry->config = config;
    entry->lease = std::move(kv_lease);
    const std::string id = entry->id;
    if (absl::Status s = registry_.AddKv(std::move(entry)); !s.ok()) return s;  // the entry's memory is freed
    job.kv_handle = id;
  }
  kv_lease.Release();  // (moved out when kept)
  job.release_seconds = absl::ToDoubleSeconds(clock_->Now() - release_start);
  return absl::OkStatus();
}

}  // namespace kvpack::server
