#include "server/backends/cuda_backend.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "absl/time/clock.h"

#include "kernels/cuda/device_caps.h"
#include "kernels/cuda/layer.h"
#include "kernels/kernel_choice.h"
#include "kernels/page_codec.h"
#include "kernels/sparse_plan.h"
#include "server/backends/vmm_arena.h"
#include "server/core/error_status.h"

namespace kvpack::server {
namespace {

// Streams of the pool: one per call running at once (executor threads, --threads, default 2, each
// with at most one backend call in flight); more only wait.
constexpr int kStreams = 8;

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

class MallocArena final : public Arena {
 public:
  void* Allocate(uint64_t bytes) override {
    void* ptr = nullptr;
    if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    mapped_ += bytes;
    return ptr;
  }
  void Free(void* ptr, uint64_t bytes) override {
    cudaFree(ptr);
    mapped_ -= bytes;
  }
  uint64_t MappedBytes() const override { return mapped_.load(); }

 private:
  std::atomic<uint64_t> mapped_{0};
};

// Non-blocking streams created once; each call borrows one for its duration, so calls on several
// executor threads never share a stream (and never a cuBLASLt workspace: that lives in each call's
// own pool workspace). More calls than streams wait for one.
class StreamPool {
 public:
  explicit StreamPool(std::vector<cudaStream_t> streams) : free_(std::move(streams)) {}
  ~StreamPool() {
    for (cudaStream_t s : free_) cudaStreamDestroy(s);
  }

  class Borrowed {
   public:
    Borrowed(StreamPool* pool, cudaStream_t stream) : pool_(pool), stream_(stream) {}
    Borrowed(const Borrowed&) = delete;
    Borrowed& operator=(const Borrowed&) = delete;
    ~Borrowed() { pool_->Return(stream_); }
    cudaStream_t get() const { return stream_; }

   private:
    StreamPool* pool_;
    cudaStream_t stream_;
  };

  Borrowed Borrow() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    cudaStream_t s = free_.back();
    free_.pop_back();
    return Borrowed(this, s);
  }

 private:
  void Return(cudaStream_t s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(s);
    }
    cv_.notify_one();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<cudaStream_t> free_;
};

// The engine's chunk gate for one call on `stream` (backend.h). Beside other calls, each gate first
// waits for the stream to drain, so a gate that hands the GPU to another call hands it over idle.
// Alone (`runs_alone`), the stream runs one chunk ahead: the gate before chunk n waits only for the
// chunks before n − 1 (an event recorded at the previous gate), so chunk n is queued while chunk
// n − 1 runs and no host round trip (synchronise, wake, launch: tens of µs each) separates them; a
// cancelled call then stops within two chunks. The last launch also comes one chunk sooner, and with
// it the early answer of header.cuda_done_event. A call that joins between the probe and the gate's
// hand-over finds at most one chunk of this call still queued on the GPU.
class ChunkPacer {
 public:
  ChunkPacer(const ChunkGate& gate, cudaStream_t stream, const std::function<bool()>& runs_alone)
      : gate_(gate), stream_(stream), runs_alone_(runs_alone) {}
  ChunkPacer(const ChunkPacer&) = delete;
  ChunkPacer& operator=(const ChunkPacer&) = delete;
  ~ChunkPacer() {
    for (cudaEvent_t e : marks_) {
      if (e != nullptr) cudaEventDestroy(e);  // a pending record is released once it completes
    }
  }

  // Null when the engine passed no gate (the kernels then run their chunks straight through).
  ChunkGate Gate() {
    if (!gate_) return nullptr;
    return [this]() -> Error { return Pass(); };
  }

 private:
  Error Pass() {
    const int64_t n = calls_++;
    if (runs_alone_ && runs_alone_()) {
      // marks_[n % 2]: chunks before n. marks_[(n + 1) % 2], recorded at gate n − 1: chunks before
      // n − 1 (or older, when that gate drained the stream instead — then they are done already).
      cudaEvent_t& mark = marks_[n % 2];
      if (mark == nullptr) {
        if (cudaError_t e = cudaEventCreateWithFlags(&mark, cudaEventDisableTiming); e != cudaSuccess) {
          mark = nullptr;
          return Error(ErrorCode::kInternal, std::string("chunk: cudaEventCreate: ") + cudaGetErrorString(e));
        }
      }
      if (cudaError_t e = cudaEventRecord(mark, stream_); e != cudaSuccess) {
        return Error(ErrorCode::kInternal, std::string("chunk: cudaEventRecord: ") + cudaGetErrorString(e));
      }
      if (cudaEvent_t before = marks_[(n + 1) % 2]; before != nullptr) {
        if (cudaError_t e = cudaEventSynchronize(before); e != cudaSuccess) {
          return Error(ErrorCode::kInternal, std::string("chunk: ") + cudaGetErrorString(e));
        }
      }
    } else if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      return Error(ErrorCode::kInternal, std::string("chunk: ") + cudaGetErrorString(e));
    }
    return gate_();
  }

  const ChunkGate& gate_;
  const cudaStream_t stream_;
  const std::function<bool()>& runs_alone_;
  cudaEvent_t marks_[2] = {nullptr, nullptr};
  int64_t calls_ = 0;
};

// Events of callers in other processes (LayerHeader.cuda_wait_event), opened once per handle: a
// client re-records one event call after call. At most kMaxEvents are kept (a client cannot make
// the daemon hold an unbounded number); past that the cache starts again. Entries are shared, so
// a wait in progress keeps its event open when the cache is cleared.
class IpcEvents {
 public:
  static constexpr size_t kMaxEvents = 256;
  using Event = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;

  // `field` names the header field in errors.
  absl::StatusOr<Event> Open(const std::string& handle, const std::string& field = "header.cuda_wait_event") {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = events_.find(handle); it != events_.end()) return it->second;
    cudaIpcEventHandle_t h;
    if (handle.size() != sizeof(h)) {
      return absl::InvalidArgumentError(field + ": not a cudaIpcEventHandle_t");
    }
    std::memcpy(&h, handle.data(), sizeof(h));
    cudaEvent_t raw = nullptr;
    if (cudaError_t e = cudaIpcOpenEventHandle(&raw, h); e != cudaSuccess) {
      cudaGetLastError();  // not sticky: a bad handle is the caller's error
      return absl::InvalidArgumentError(field + ": cudaIpcOpenEventHandle: " + cudaGetErrorString(e));
    }
    if (events_.size() >= kMaxEvents) events_.clear();
    Event event(raw, [](cudaEvent_t ev) { cudaEventDestroy(ev); });
    events_.emplace(handle, event);
    return event;
  }

 private:
  std::mutex mu_;
  std::map<std::string, Event> events_;  // by the 64 handle bytes
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const CudaBackendOptions& options, KernelInfo kernel, std::vector<cudaStream_t> streams,
              cublasLtHandle_t blas)
      : options_(options), kernel_(std::move(kernel)), streams_(std::move(streams)), blas_(blas) {}

  ~CudaBackend() override { cublasLtDestroy(blas_); }

  std::string name() const override { return "cuda"; }

  absl::Status Supported(const LayerConfig& config) const override {
    if (absl::Status s = ToStatus(cuda::Supported(config)); !s.ok()) return s;
    // The attention kernel for the largest page on this GPU (kernel_choice.h): pages this GPU's
    // shared memory cannot hold (INT8 / BF16 at d = 128 on a 99 KB consumer GPU) fail here, before
    // any memory is reserved, rather than after the K/V projection.
    int max_page_bytes = 0;
    for (const TokenRange& r : config.ranges) {
      max_page_bytes = std::max(max_page_bytes, PageBytes(r.format, config.shape.head_dim));
    }
    if (max_page_bytes == 0) return absl::OkStatus();  // no ranges: cuda::Supported's checks speak
    DeviceCaps caps;
    AttentionKernelChoice choice;
    if (Error e = cuda::DeviceCapsOf(options_.device, &caps); !e.ok()) return ToStatus(e);
    if (absl::Status s = ToStatus(
            ChooseAttentionKernel(caps, config.shape.head_dim, max_page_bytes, options_.attention_kernel, &choice));
        !s.ok()) {
      return s;
    }
    // Sparse: its attention kernels need no more shared memory than the dense one chosen above (the
    // routed wgmma instance has the dense tile; the portable kernel holds 64 rows instead of 128), but
    // the routing kernel's sort grows with the pages.
    if (config.attention.sparse.enabled) {
      const int64_t pages = SparsePageCount(config);
      const int route = SparseRouteSharedBytes(pages);
      if (route > caps.smem_per_block_optin) {
        return ToStatus(Error(ErrorCode::kUnsupported,
                              "options.attention.sparse: routing " + std::to_string(pages) + " pages sorts " +
                                  std::to_string(route) + " bytes of shared memory per block; " +
                                  ComputeCapabilityName(caps) + " allows " + std::to_string(caps.smem_per_block_optin) +
                                  " (split the sequence or attend densely)"));
      }
    }
    return absl::OkStatus();
  }
  uint64_t KvBytes(const LayerConfig& config) const override { return cuda::KvBytes(config); }
  uint64_t WorkspaceBytes(const LayerConfig& config) const override { return cuda::WorkspaceBytes(config); }
  uint64_t RoutingBytes(const LayerConfig& config) const override { return cuda::RoutingBytes(config); }

  // Device copies of x (read by the projection and overwritten in place), RoPE positions and, when
  // not in place, the output.
  uint64_t IoBytes(const LayerConfig& config, const TensorResidency& resident) const override {
    return HostStagingBytes(config, resident);
  }

  absl::StatusOr<IpcMapping> OpenIpcRegion(const std::string& handle, int device, uint64_t size) override {
    if (device != options_.device) {
      return absl::FailedPreconditionError("device: the region is on CUDA device " + std::to_string(device) +
                                           "; this daemon serves device " + std::to_string(options_.device));
    }
    cudaIpcMemHandle_t h;
    if (handle.size() != sizeof(h)) return absl::InvalidArgumentError("cuda_ipc_handle: not a cudaIpcMemHandle_t");
    std::memcpy(&h, handle.data(), sizeof(h));
    (void)size;  // the exporter's allocation size is not queryable; the service bounds-checks against `size`
    // One allocation is opened once: PyTorch's caching allocator puts several tensors (q, k, v,
    // the output) in one cudaMalloc segment, so several regions share a handle, and a second
    // cudaIpcOpenMemHandle of it in this process would fail. Regions hold a count on the mapping.
    std::lock_guard<std::mutex> lock(ipc_mu_);
    IpcOpen& open = ipc_open_[handle];
    if (open.refs == 0) {
      void* base = nullptr;
      if (cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
        cudaGetLastError();  // not sticky: a bad handle is the caller's error
        ipc_open_.erase(handle);
        return absl::InvalidArgumentError(std::string("cuda_ipc_handle: cudaIpcOpenMemHandle: ") + cudaGetErrorString(e));
      }
      open.base = static_cast<uint8_t*>(base);
    }
    ++open.refs;
    IpcMapping mapping;
    mapping.base = open.base;
    mapping.close = [this, handle](uint8_t*, uint64_t) { CloseIpc(handle); };
    return mapping;
  }

  bool TakesIpcEvents() const override { return true; }

  // Polled (spinning first, then sleeping) rather than cudaEventSynchronize: a caller whose
  // stream never reaches the event must not hold an executor thread past the call's deadline.
  // The first ~100 µs spin, as the caller's remaining work is usually that short. The sleeps run
  // with a 1 µs timer slack: at Linux's default 50 µs a 20 µs sleep lasts ~70 µs, and the GPU
  // idles for the time between the caller's event and the poll that sees it.
  absl::Status WaitIpcEvent(const std::string& handle, absl::Time deadline) override {
    absl::StatusOr<IpcEvents::Event> event = ipc_events_.Open(handle);
    if (!event.ok()) return event.status();
#ifdef __linux__
    thread_local const bool precise_sleeps = prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL) == 0;
    (void)precise_sleeps;  // best effort: the wait is right either way, only later by the slack
#endif
    const absl::Time spin_until = absl::Now() + absl::Microseconds(100);
    for (;;) {
      const cudaError_t e = cudaEventQuery(event->get());
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) {
        // Not Sticky(): an event of a process that died is the caller's; a device fault shows up
        // again in the next launch, which flips health.
        cudaGetLastError();
        return absl::FailedPreconditionError(std::string("header.cuda_wait_event: cudaEventQuery: ") +
                                             cudaGetErrorString(e));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError("the deadline passed while waiting for header.cuda_wait_event");
      }
      if (now < spin_until) {
        std::this_thread::yield();
      } else {
        absl::SleepFor(absl::Microseconds(20));
      }
    }
  }

  absl::Status ProjectKv(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
                         const ChunkGate& gate) override {
    StreamPool::Borrowed stream = streams_.Borrow();
    ChunkPacer pacer(gate, stream.get(), runs_alone_);
    return Finish(cuda::ProjectKv(config, tensors, kv, workspace, Context(stream.get()), pacer.Gate()), stream.get());
  }

  absl::Status AttendLayer(const LayerConfig& config, const LayerTensors& tensors, const uint8_t* kv,
                           uint8_t* workspace, const ChunkGate& gate, SparseReport* sparse_report) override {
    const KvLayout layout = PlanKvLayout(config.shape, config.ranges);
    const KvEntryView view = MakeKvView(layout, config.shape, kv, config.transforms);
    StreamPool::Borrowed stream = streams_.Borrow();
    ChunkPacer pacer(gate, stream.get(), runs_alone_);
    return Finish(
        cuda::AttendLayer(config, tensors, view, workspace, Context(stream.get()), pacer.Gate(), sparse_report),
        stream.get());
  }

  // The event is recorded on the call's own stream after cuda::AttendLayer's last launch, so it
  // completes when the output is written; `launched` answers the caller then, while this thread
  // still waits for the stream (Finish), so the engine releases the call's memory only after it.
  absl::Status AttendLayerSignalled(const LayerConfig& config, const LayerTensors& tensors, const uint8_t* kv,
                                    uint8_t* workspace, const ChunkGate& gate, const std::string& done_event,
                                    const std::function<void()>& launched, SparseReport* sparse_report) override {
    absl::StatusOr<IpcEvents::Event> event = ipc_events_.Open(done_event, "header.cuda_done_event");
    if (!event.ok()) return event.status();
    const KvLayout layout = PlanKvLayout(config.shape, config.ranges);
    const KvEntryView view = MakeKvView(layout, config.shape, kv, config.transforms);
    StreamPool::Borrowed stream = streams_.Borrow();
    ChunkPacer pacer(gate, stream.get(), runs_alone_);
    Error error =
        cuda::AttendLayer(config, tensors, view, workspace, Context(stream.get()), pacer.Gate(), sparse_report);
    if (error.ok()) {
      if (cudaError_t e = cudaEventRecord(event->get(), stream.get()); e != cudaSuccess) {
        error = Error(ErrorCode::kInternal, std::string("header.cuda_done_event: cudaEventRecord: ") +
                                                cudaGetErrorString(e));
      }
    }
    if (config.attention.sparse.enabled) {  // the report is read after the kernels: answer then
      absl::Status s = Finish(error, stream.get());
      if (s.ok()) launched();
      return s;
    }
    if (error.ok()) launched();
    return Finish(error, stream.get());
  }

  bool TakesTurns() const override { return true; }
  void SetRunsAlone(std::function<bool()> runs_alone) override { runs_alone_ = std::move(runs_alone); }

  // The VMM arena; plain cudaMalloc per allocation where the driver has no VMM support.
  std::unique_ptr<Arena> CreateArena() override {
    std::string why;
    VmmArenaOptions vmm{options_.device, options_.reserve_bytes, options_.keep_mapped_bytes};
    if (std::unique_ptr<Arena> arena = MakeVmmArena(vmm, &why)) return arena;
    return std::make_unique<MallocArena>();
  }

  // Staging copies go on the call's own stream: copies of one request overlap another's kernels
  // (the copy engines are separate from the SMs), which is why they take no GPU turn.
  absl::Status CopyToPool(void* dst, const void* src, uint64_t bytes) override {
    StreamPool::Borrowed stream = streams_.Borrow();
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream.get());
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream.get());
    return Sticky(CudaStatus(e, "copy to device"));
  }

  absl::Status CopyFromPool(void* dst, const void* src, uint64_t bytes) override {
    StreamPool::Borrowed stream = streams_.Borrow();
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream.get());
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream.get());
    return Sticky(CudaStatus(e, "copy from device"));
  }

  DeviceMemory QueryDeviceMemory() const override {
    DeviceMemory m;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      m.present = true;
      m.free_bytes = free_bytes;
      m.total_bytes = total_bytes;
    }
    return m;
  }

  DeviceIdentity Identity() const override {
    std::call_once(identity_once_, [this] {
      identity_.ordinal = options_.device;
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, options_.device) == cudaSuccess) {
        const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
        char text[64];
        std::snprintf(text, sizeof(text), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                      u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
        identity_.uuid = text;
      }
      char bus[32] = {};
      if (cudaDeviceGetPCIBusId(bus, sizeof(bus), options_.device) == cudaSuccess) identity_.pci_bus_id = bus;
      cudaGetLastError();
    });
    return identity_;
  }

  KernelInfo Kernel() const override { return kernel_; }

  bool ReadsHostMemory() const override { return false; }
  bool Healthy() const override { return healthy_.load(); }

 private:
  cuda::CudaContext Context(cudaStream_t stream) const {
    cuda::CudaContext context;
    context.stream = stream;
    context.blas = blas_;  // shared: a cuBLASLt handle holds no stream or workspace, both go with each call
    context.attention_tiling = options_.attention_kernel;
    return context;
  }

  // Waits for the launches of a call so that an error inside a kernel belongs to this request.
  absl::Status Finish(const Error& error, cudaStream_t stream) {
    if (!error.ok()) {
      cudaStreamSynchronize(stream);  // the stream goes back to the pool idle
      return Sticky(ToStatus(error));
    }
    return Sticky(CudaStatus(cudaStreamSynchronize(stream), "layer"));
  }

  absl::Status Sticky(absl::Status status) {
    if (status.code() == absl::StatusCode::kInternal) healthy_ = false;
    return status;
  }

  struct IpcOpen {
    uint8_t* base = nullptr;
    int refs = 0;
  };
  void CloseIpc(const std::string& handle) {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    auto it = ipc_open_.find(handle);
    if (it == ipc_open_.end() || --it->second.refs > 0) return;
    cudaIpcCloseMemHandle(it->second.base);
    ipc_open_.erase(it);
  }

  const CudaBackendOptions options_;
  const KernelInfo kernel_;
  StreamPool streams_;
  mutable std::once_flag identity_once_;
  mutable DeviceIdentity identity_;
  std::mutex ipc_mu_;
  std::map<std::string, IpcOpen> ipc_open_;  // by the 64 handle bytes
  IpcEvents ipc_events_;
  std::function<bool()> runs_alone_;  // the engine's probe (SetRunsAlone); null: never alone
  cublasLtHandle_t blas_;
  std::atomic<bool> healthy_{true};
};

}  // namespace

namespace {

// What Status and /metrics report, and the check of a forced kernel: the choice for INT4 pages at
// head_dim 128 (they fit every supported GPU; a request's own pages are checked per call).
absl::Status DescribeKernel(const CudaBackendOptions& options, const DeviceCaps& caps, KernelInfo* info) {
  info->compute_capability = ComputeCapabilityName(caps);
  info->cuda_archs_built = cuda::CudaArchsBuilt();
  info->sm_count = caps.sm_count;
  AttentionKernelChoice choice;
  const Error e = ChooseAttentionKernel(caps, 128, PageBytes(PageFormat::kInt4, 128), options.attention_kernel, &choice);
  if (!e.ok()) {
    return absl::FailedPreconditionError(std::string("--attention_kernel=") +
                                         AttentionKernelName(options.attention_kernel) + ": " + e.message());
  }
  info->attention_kernel = AttentionKernelName(choice.tiling);
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Backend> MakeCudaBackend(const CudaBackendOptions& options, std::string* why, absl::Status* refused) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    *why = e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device";
    cudaGetLastError();
    return nullptr;
  }
  if (options.device >= count) {
    *why = "device " + std::to_string(options.device) + " of " + std::to_string(count);
    return nullptr;
  }
  cudaDeviceProp prop{};
  if (cudaSetDevice(options.device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, options.device) != cudaSuccess) {
    *why = "cudaSetDevice failed";
    return nullptr;
  }
  if (prop.major < 8) {
    *why = std::string(prop.name) + " is compute capability " + std::to_string(prop.major) + "." +
           std::to_string(prop.minor) + "; the kernels need sm_80 or newer";
    return nullptr;
  }
  DeviceCaps caps;
  if (Error e = cuda::DeviceCapsOf(options.device, &caps); !e.ok()) {
    *why = e.message();
    return nullptr;
  }
  if (Error e = BinaryRunsOn(cuda::CudaArchsBuilt(), caps); !e.ok()) {
    *why = std::string(prop.name) + ": " + e.message();
    return nullptr;
  }
  KernelInfo kernel;
  if (absl::Status s = DescribeKernel(options, caps, &kernel); !s.ok()) {
    if (options.attention_kernel != AttentionTilingChoice::kAuto) {
      *refused = s;  // the operator asked for a kernel this GPU or build cannot run
    } else {
      *why = std::string(s.message());
    }
    return nullptr;
  }
  CudaBackendOptions resolved = options;
  if (resolved.reserve_bytes == 0) resolved.reserve_bytes = prop.totalGlobalMem;  // address space is cheap
  std::vector<cudaStream_t> streams;
  const auto destroy = [&] {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  };
  for (int i = 0; i < kStreams; ++i) {
    cudaStream_t stream = nullptr;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
      destroy();
      *why = "cudaStreamCreate failed";
      return nullptr;
    }
    streams.push_back(stream);
  }
  cublasLtHandle_t blas = nullptr;
  if (cublasLtCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
    destroy();
    *why = "cublasLtCreate failed";
    return nullptr;
  }
  return std::make_unique<CudaBackend>(resolved, std::move(kernel), std::move(streams), blas);
}

}  // namespace kvpack::server
