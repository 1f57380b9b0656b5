// The daemon's state below the gRPC layer: backend, pool, scheduler, executor, registry, metrics,
// and the one place a layer job runs (on an executor thread, never a gRPC thread).
//
// A LayerJob is built by the service from a validated request (tensors received or mapped), then
// Submit()ted: the scheduler admits it when its predicted peak is free, the executor runs it, and
// job->done(status) is called exactly once — from the thread that submitted it (early rejection),
// the scheduler's pump (deadline, cancel) or the executor (after running).
//
// Thread safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/backends/backend.h"
#include "server/core/clock.h"
#include "server/core/executor.h"
#include "server/core/fault_injector.h"
#include "server/core/planner.h"
#include "server/core/policy.h"
#include "server/core/pool.h"
#include "server/core/scheduler.h"
#include "server/core/turns.h"
#include "server/runtime/inline_budget.h"
#include "server/runtime/metrics.h"
#include "server/runtime/registry.h"

namespace kvpack::server {

struct EngineOptions {
  uint64_t budget_bytes = 0;
  SchedulerOptions scheduler;
  TurnOptions turns;  // GPU turns between running requests, on backends that TakesTurns()
  int executor_threads = 1;
  int executor_nice = 0;  // --layer_nice: CPU priority of the threads that run layers (Executor)
  absl::Duration lease = absl::Minutes(10);
  int64_t max_chunk_tokens = 16384;  // cap on Tp and Tq: the CPU backend stops between chunks
  uint64_t tenant_quota_bytes = 0;  // 0: none; caps each tenant's pool bytes (weights, kept K/V, plans)
  uint64_t max_inline_bytes_in_flight = 4ull << 30;  // host bytes of inline tensors of all calls (inline_budget.h)
  RegistryLimits registry;
  std::string version = "0.1.0";
  // Tests only (server/core/fault_injector.h): fails chosen pool allocations, shm maps and device
  // calls. Null in the daemon. REQUIRES: outlives the Engine.
  FaultInjector* faults = nullptr;
};

enum class LayerMode { kFull, kProject, kAttend };

struct LayerJob {
  LayerMode mode = LayerMode::kFull;
  std::string method;  // RPC name, for metrics
  std::string tenant;
  int priority = 0;
  absl::Time deadline = absl::InfiniteFuture();
  absl::Time submitted;
  LayerPlan plan;
  std::shared_ptr<WeightsEntry> weights;  // null with pre-projected input
  std::shared_ptr<KvEntry> kv_in;     // kAttend
  bool keep_kv = false;
  LayerTensors tensors;               // x (or q, k, v), positions, out set by the service
  // Which of them already sit in device memory (CUDA IPC regions); the others are host memory
  // (inline buffers, shared-memory regions) and are staged through the pool on a GPU backend.
  TensorResidency resident;
  uint64_t out_bytes = 0;
  std::vector<RegionUse> regions;     // keeps mapped regions alive for the job
  std::string wait_event;             // header.cuda_wait_event: waited for before the layer runs
  // header.cuda_done_event: recorded after the attention's last kernel; `done` then runs with OK
  // before those kernels finish (`replied` set first) and is not run again. The job keeps its
  // memory, weights and regions until Run returns, after the kernels.
  std::string done_event;
  bool replied = false;               // written and read on the executor thread only
  InlineBudget::Lease inline_lease;   // the buffers' bytes; declared first, so released after them
  std::unique_ptr<uint8_t[]> x_buf;   // inline inputs and output (host)
  std::unique_ptr<uint8_t[]> positions_buf;
  std::unique_ptr<uint8_t[]> qkv_buf[3];  // inline pre-projected q, k, v
  std::unique_ptr<uint8_t[]> out_buf;
  std::atomic<bool> cancelled{false};
  std::atomic<uint64_t> ticket{0};    // scheduler id while waiting
  std::atomic<uint64_t> task{0};      // executor task id once admitted (withdrawn on cancel, drain)
  std::atomic<uint64_t> turn{0};      // TurnArbiter id while running on a backend that TakesTurns()

  // Results.
  std::string kv_handle;
  uint64_t peak_bytes = 0;
  // Where the daemon's time went (LayerResult.seconds): project and attend include turn_wait;
  // allocate is taking the pool memory (mapping physical chunks on the GPU), release giving it back.
  double queue_seconds = 0, project_seconds = 0, attend_seconds = 0, transfer_seconds = 0;
  double allocate_seconds = 0, turn_wait_seconds = 0, release_seconds = 0;
  // The run's own error estimate, read from the entry's head_estimates table after ProjectKv
  // (absent when the pre-pass made none: CUDA backend, caller's stats, transforms off, Attend).
  ErrorEstimate estimate;
  // Block-sparse attention's tallies (LayerResult.routed_fraction); zeros when sparse is off.
  SparseReport sparse_report;
  std::function<void(absl::Status)> done;
};

class Engine {
 public:
  Engine(EngineOptions options, std::unique_ptr<Backend> backend, const Clock* clock);
  ~Engine();

  Backend& backend() { return *backend_; }
  Pool& pool() { return *pool_; }
  Registry& registry() { return registry_; }
  InlineBudget& inline_budget() { return inline_budget_; }
  PolicyRegistry& policies() { return policies_; }
  Scheduler& scheduler() { return *scheduler_; }
  Metrics& metrics() { return *metrics_; }
  const Clock& clock() const { return *clock_; }
  const EngineOptions& options() const { return options_; }

  PlannerCosts Costs() const;
  // Bytes one request of `tenant` may plan for: the budget minus what weights and kept K/V hold,
  // and at most the tenant's quota minus the tenant's pool bytes.
  uint64_t CapacityFor(const std::string& tenant) const;
  // Plans `request` for `tenant`; with `kv` (Attend) the formats are the entry's and K/V costs nothing.
  absl::StatusOr<LayerPlan> Plan(const std::string& tenant, const LayerRequest& request,
                                 const KvEntry* kv = nullptr) const;
  // Checks that a tenant may hold `bytes` more (quota); RESOURCE_EXHAUSTED with the numbers.
  absl::Status CheckQuota(const std::string& tenant, uint64_t bytes) const;

  // Queues the job; done() is called once, possibly before Submit returns.
  void Submit(std::shared_ptr<LayerJob> job);
  // Stops a job: removes it from the queue, or from the executor's queue when it was admitted but
  // no executor thread has taken it yet (either way its reservation is freed and done() called at
  // once), or flags it so the backend stops at the next chunk (a job waiting for a GPU turn stops
  // waiting at once).
  void Cancel(const std::shared_ptr<LayerJob>& job);

  // Periodic work: deadlines in the queue, expired leases, the device-memory snapshot.
  void Tick();
  // Shutdown, step one: rejects with UNAVAILABLE every job that has not started — waiting for memory,
  // admitted but waiting for an executor thread, or submitted from now on. Returns at once.
  void RejectQueued();
  // RejectQueued(), then waits for the running jobs.
  void Drain();

  // Snapshots only: Status and /metrics must not wait behind layer work. Device memory is the
  // value Tick() last read (cudaMemGetInfo may wait on the driver while a layer maps memory).
  GaugeValues Gauges() const;
  // Where Gauges() reads the lanes open (the service's lane table); empty: 0. The service sets it
  // and clears it before it goes.
  void SetLaneCount(std::function<int()> count);
  // Jobs running on an executor thread now (not those admitted and waiting for one).
  int Running() const;
  std::map<std::string, int> RunningByTenant() const;
  bool Healthy() const { return backend_->Healthy(); }

 private:
  void Run(const std::shared_ptr<LayerJob>& job, Pool::Reservation reservation);
  absl::Status WaitForCaller(LayerJob& job);
  void RefreshDeviceMemory();
  // Takes an admitted job back from the executor if no thread has started it: its reservation is
  // freed and done(status) called. False when it started (or was never posted).
  bool Withdraw(const std::shared_ptr<LayerJob>& job, absl::Status status);
  // The bookkeeping of an admitted job that ends (ran or withdrawn).
  void Retire(const LayerJob& job);
  absl::Status StageOnDevice(LayerJob& job, Pool::Reservation& reservation, LayerTensors* tensors, Pool::Lease* io,
                             uint16_t** host_out);
  absl::Status RunLocked(LayerJob& job, Pool::Reservation& reservation);
  // The gate of the job's backend calls: stops on cancel or deadline, and takes the job's GPU turn
  // for each chunk when turns are on.
  ChunkGate GateOf(LayerJob& job);
  // The quota share of an admitted job: its tenant's pool bytes plus the peaks of its other
  // admitted jobs plus this one stay within --tenant_quota (conservative: a running job's
  // allocations count in both terms).
  bool TryClaim(const std::string& tenant, uint64_t bytes);
  void Unclaim(const std::string& tenant, uint64_t bytes);

  const EngineOptions options_;
  const Clock* const clock_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Pool> pool_;
  Registry registry_;
  InlineBudget inline_budget_;
  PolicyRegistry policies_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<TurnArbiter> turns_;  // null on backends whose calls run side by side (CPU)
  std::unique_ptr<Metrics> metrics_;
  mutable std::mutex mu_;
  std::map<std::string, int> running_;  // by tenant
  std::map<std::string, uint64_t> claimed_;  // by tenant: predicted peaks of admitted jobs (quota)
  int running_total_ = 0;
  std::map<uint64_t, std::shared_ptr<LayerJob>> posted_;  // by task id: admitted, not yet started
  std::atomic<bool> draining_{false};
  mutable std::mutex device_mu_;
  mutable std::mutex lane_count_mu_;
  std::function<int()> lane_count_;  // guarded by lane_count_mu_
  DeviceMemory device_memory_;  // refreshed by Tick (every 50 ms in kvpackd)
  absl::Time last_finished_ = absl::InfinitePast();  // when the last job ended (idle trimming)
  std::unique_ptr<Executor> executor_;  // last: joined first on destruction
};

// Pool bytes of packed pages by format for a K/V block laid out from `config`.
std::array<uint64_t, kNumPageFormats> KvFormatBytes(const LayerConfig& config);

}  // namespace kvpack::server
