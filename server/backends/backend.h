// The Backend interface: what the service needs from an engine that runs layers. Every backend
// answers the three questions of STYLE.md §3 — Supported, KvBytes/WorkspaceBytes (plus IoBytes, the
// device copies of inputs and outputs), Run — and says where its pool memory lives (its Arena).
//
// Memory spaces. Pool memory (the Arena's) is the backend's memory: host on the CPU backend, device
// on CUDA. Tensors named by LayerTensors are in pool memory or, on the CPU backend, host memory the
// service hands over (inline uploads, shared-memory regions). CopyToPool/CopyFromPool move bytes
// between host memory and pool memory (memcpy on the CPU backend).
//
// Errors. Backends return absl::Status, converted from kernels' Error by ToStatus (error_status.h).
// An INTERNAL error from a device is sticky: Healthy() turns false and the daemon reports NOT_SERVING.
//
// Thread safety: every method may be called from several executor threads at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/kernel_choice.h"
#include "kernels/layer_spec.h"
#include "server/core/layer_request.h"
#include "server/core/pool.h"

namespace kvpack::server {

struct DeviceMemory {
  bool present = false;  // false on the CPU backend
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
};

// Which GPU a backend serves (Status): ordinal -1 and empty strings on the CPU backend.
struct DeviceIdentity {
  int ordinal = -1;
  std::string uuid;        // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
  std::string pci_bus_id;  // "0000:3b:00.0"
};

// Which attention kernel serves and on what (Status fields 32–35, /metrics kvpack_device_info).
// The CPU backend: kernel "cpu", the rest empty / 0.
struct KernelInfo {
  std::string compute_capability;      // the GPU's, "sm_86"
  std::string attention_kernel = "cpu";  // "wgmma" or "mma_sync" (kernels/kernel_choice.h) or "cpu"
  std::string cuda_archs_built;        // "sm_80,…,compute_120": the code the binary holds
  int sm_count = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;  // "cpu" or "cuda" (the metric label)

  // ── The three questions ──
  virtual absl::Status Supported(const LayerConfig& config) const = 0;
  virtual uint64_t KvBytes(const LayerConfig& config) const = 0;
  virtual uint64_t WorkspaceBytes(const LayerConfig& config) const = 0;
  // Of the workspace, what block-sparse routing takes (0 with sparse off): reported in the Plan.
  virtual uint64_t RoutingBytes(const LayerConfig& config) const = 0;
  // Pool bytes for device copies of x, positions and the output (0 when the backend reads host
  // memory directly, as the CPU backend does).
  virtual uint64_t IoBytes(const LayerConfig& config, const TensorResidency& resident) const = 0;

  // REQUIRES: Supported(config).ok(); kv has KvBytes, workspace WorkspaceBytes bytes (pool memory).
  // `gate` (kernels/layer_spec.h) is called before each chunk; its error stops the call. On a backend
  // that TakesTurns(), the work of the previous chunk has finished whenever the gate is called while
  // SetRunsAlone's probe says other calls run, so a gate that hands the device to another call hands
  // it over idle; while the call runs alone, only the chunk before the previous one has (the device
  // has the next chunk queued while the host prepares it, and a cancelled call stops within two
  // chunks). The call's work has finished when these return.
  virtual absl::Status ProjectKv(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv,
                                 uint8_t* workspace, const ChunkGate& gate) = 0;
  // With config.attention.sparse, the tallies of the routing are added to *sparse_report (when set).
  virtual absl::Status AttendLayer(const LayerConfig& config, const LayerTensors& tensors, const uint8_t* kv,
                                   uint8_t* workspace, const ChunkGate& gate, SparseReport* sparse_report) = 0;
  // AttendLayer, stream-ordered with a caller in another process (LayerHeader.cuda_done_event):
  // records the event behind `done_event` (the 64 bytes of a cudaIpcEventHandle_t) after the
  // attention's last kernel, runs `launched` (the caller hears back then), and returns once those
  // kernels have finished, as AttendLayer does: what the call holds is released after the return,
  // so never while its kernels run. `launched` does not run when the launches fail. Sparse attention
  // counts its routed pages on the device: with it on, `launched` runs once the kernels have finished
  // and `sparse_report` is filled (the answer carries the routed fraction; the event is recorded all
  // the same, so the caller's wait on it is immediate).
  // FAILED_PRECONDITION on backends without CUDA (TakesIpcEvents() false).
  virtual absl::Status AttendLayerSignalled(const LayerConfig& config, const LayerTensors& tensors, const uint8_t* kv,
                                            uint8_t* workspace, const ChunkGate& gate, const std::string& done_event,
                                            const std::function<void()>& launched, SparseReport* sparse_report) {
    (void)config;
    (void)tensors;
    (void)kv;
    (void)workspace;
    (void)gate;
    (void)done_event;
    (void)launched;
    (void)sparse_report;
    return absl::FailedPreconditionError("header.cuda_done_event: CUDA IPC events need the CUDA backend; this daemon "
                                         "serves on the " + name() + " backend");
  }
  // Whether calls running at once share one device and should take turns chunk by chunk through
  // their gates (server/core/turns.h): true on the CUDA backend (one GPU, whose chunks run one at a
  // time so that a short request need not wait for a whole long layer); false on the CPU backend,
  // whose calls run side by side on their own threads.
  virtual bool TakesTurns() const { return false; }
  // On a backend that TakesTurns(): the engine's probe of whether the calling request is the only
  // one running (TurnArbiter::Participants() <= 1; a request joins once its caller's event has
  // completed), asked at each chunk gate. Null (the default): never alone. REQUIRES: set before the first layer call, at most once; thread-safe to call.
  virtual void SetRunsAlone(std::function<bool()> runs_alone) { (void)runs_alone; }

  // ── Memory ──
  virtual std::unique_ptr<Arena> CreateArena() = 0;
  virtual absl::Status CopyToPool(void* pool_dst, const void* host_src, uint64_t bytes) = 0;
  virtual absl::Status CopyFromPool(void* host_dst, const void* pool_src, uint64_t bytes) = 0;
  virtual DeviceMemory QueryDeviceMemory() const { return {}; }
  virtual DeviceIdentity Identity() const { return {}; }
  virtual KernelInfo Kernel() const { return {}; }
  // The MMA path (kernels/mma_path.h) a layer of `config` runs here: config.attention.mma resolved
  // against its formats, head_dim and rotation (every CUDA kernel runs every path; the CPU emulates
  // each).
  MmaPath ResolvedMma(const LayerConfig& config) const;
  // Whether tensors in host memory (inline uploads, shm regions) can be passed straight to Run.
  virtual bool ReadsHostMemory() const = 0;

  // Opens a CUDA IPC memory handle (the 64 bytes of a cudaIpcMemHandle_t) exported by a process on the
  // same host, `size` bytes from its base, on CUDA device `device`. `close` unmaps it
  // (cudaIpcCloseMemHandle). FAILED_PRECONDITION on backends without CUDA.
  struct IpcMapping {
    uint8_t* base = nullptr;
    std::function<void(uint8_t*, uint64_t)> close;
  };
  virtual absl::StatusOr<IpcMapping> OpenIpcRegion(const std::string& handle, int device, uint64_t size) {
    (void)handle;
    (void)device;
    (void)size;
    return absl::FailedPreconditionError("kind: CUDA IPC regions need the CUDA backend; this daemon serves on the " +
                                         name() + " backend");
  }

  // Stream order with a caller in another process (LayerHeader.cuda_wait_event): whether the
  // backend takes such events, and a wait until the event behind `handle` (the 64 bytes of a
  // cudaIpcEventHandle_t) has completed. DEADLINE_EXCEEDED when it has not by `deadline`;
  // INVALID_ARGUMENT naming header.cuda_wait_event when the handle does not open;
  // FAILED_PRECONDITION on backends without CUDA.
  virtual bool TakesIpcEvents() const { return false; }
  virtual absl::Status WaitIpcEvent(const std::string& handle, absl::Time deadline) {
    (void)handle;
    (void)deadline;
    return absl::FailedPreconditionError("header.cuda_wait_event: CUDA IPC events need the CUDA backend; this daemon "
                                         "serves on the " + name() + " backend");
  }

  // False after a sticky device error.
  virtual bool Healthy() const { return true; }
};

// Pool bytes a backend that cannot read host memory needs to stage a layer's host-resident tensors
// (x [N, D] bf16 — or with projected input q, k and v, each its span of
// ProjectedLayout::SpanElements bf16 — RoPE positions [N, axes] f32, the output [N, H·d] bf16 unless
// in place), each rounded to the pool granule; tensors in `resident` (CUDA IPC regions) need none. The engine stages
// them in this order (Engine::StageOnDevice).
uint64_t HostStagingBytes(const LayerConfig& config, const TensorResidency& resident);

enum class BackendKind { kAuto, kCpu, kCuda };
absl::StatusOr<BackendKind> ParseBackendKind(const std::string& text);

struct BackendOptions {
  BackendKind kind = BackendKind::kAuto;
  int cpu_threads = 0;  // threads per CPU layer call; 0: all cores
  // --attention_kernel (kernels/kernel_choice.h ParseAttentionKernel): kAuto, kWgmma or kMmaSync.
  // Anything but kAuto needs the CUDA backend and a GPU that runs that kernel: MakeBackend fails
  // (FAILED_PRECONDITION, naming the flag and the GPU) rather than serve on something else.
  AttentionTilingChoice attention_kernel = AttentionTilingChoice::kAuto;
};

// The backend for `options.kind`: kCuda and kAuto use the CUDA backend when it is built and a
// device answers, else fall back to the CPU backend; `note` says what was chosen and why.
//
// The CUDA seam: server/backends/cuda_backend.{h,cc} (compiled when that file and the kvpack_cuda
// target exist, which defines KVPACK_HAVE_CUDA_BACKEND) provides
//   std::unique_ptr<Backend> MakeCudaBackend(const CudaBackendOptions&, std::string* why_not,
//                                            absl::Status* refused);
// with ReadsHostMemory() false, IoBytes() = HostStagingBytes, a VMM-backed Arena, OpenIpcRegion,
// QueryDeviceMemory and a sticky Healthy(). The engine stages inline and shm tensors through the pool
// with CopyToPool/CopyFromPool; tests/server/runtime/engine_test.cc runs that path on a CPU backend
// dressed as a device, tests/server/service/cuda_daemon_test.cc on the GPU.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options, std::string* note);

}  // namespace kvpack::server
