// kvpackd: serves kvpack.v1 over gRPC on one backend, with Prometheus metrics, health and
// reflection. SIGTERM/SIGINT: stop admitting, reject queued requests (UNAVAILABLE), let running
// layers finish (--drain_seconds), exit 0.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>
#include <vector>

#include "server/backends/backend.h"
#include "server/core/policy_parse.h"
#include "server/runtime/options.h"
#include "server/runtime/shm_guard.h"
#include "server/service/service.h"

namespace kvpack::server {
namespace {

// Waits, up to `limit`, until the peer of every connected stream socket of the process has closed
// its end (each client has read what was sent and hung up), so that leaving does not close a socket
// with unread bytes: that sends RST, and a peer that gets RST may drop data it has not read yet — the
// last call's status (the client saw UNAVAILABLE, "Connection reset by peer"). Only watches: gRPC's
// threads keep reading and writing these sockets. Returns how many peers were still connected.
int WaitForPeersToHangUp(std::chrono::milliseconds limit) {
  std::vector<pollfd> open;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (const dirent* e = readdir(dir)) {
      const int fd = std::atoi(e->d_name);
      struct stat st;
      if (e->d_name[0] == '.' || fd == dirfd(dir) || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
      sockaddr_storage peer;
      socklen_t len = sizeof(peer);
      int type = 0;
      socklen_t type_len = sizeof(type);
      if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_STREAM) continue;
      if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;  // listening or unconnected
      open.push_back({fd, POLLRDHUP, 0});
    }
    closedir(dir);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!open.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || poll(open.data(), open.size(), static_cast<int>(left.count())) < 0) break;
    open.erase(std::remove_if(open.begin(), open.end(),
                              [](const pollfd& p) { return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0; }),
               open.end());
  }
  return static_cast<int>(open.size());
}

constexpr char kVersion[] = "0.1.0";

std::string ReadFile(const std::string& path, bool* ok) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  *ok = static_cast<bool>(in);
  return s.str();
}

// MemAvailable from /proc/meminfo: the "free memory" of a CPU-backed pool.
uint64_t HostAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

void RaiseFileLimit(int max_regions) {
  constexpr rlim_t kOtherDescriptors = 256;  // sockets, metrics server, logs
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  limit.rlim_cur = limit.rlim_max;
  setrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < static_cast<rlim_t>(max_regions) + kOtherDescriptors) {
    std::fprintf(stderr, "kvpackd: warning: %llu file descriptors allowed; --max_regions=%d needs about %llu "
                 "(registering regions fails with RESOURCE_EXHAUSTED beyond that)\n",
                 static_cast<unsigned long long>(limit.rlim_cur), max_regions,
                 static_cast<unsigned long long>(max_regions + kOtherDescriptors));
  }
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvpackd: %s\n", message.c_str());
  return 2;
}

int Main(int argc, char** argv) {
  absl::StatusOr<DaemonOptions> options = ParseDaemonOptions(argc, argv);
  if (!options.ok()) return Fail(std::string(options.status().message()));
  if (options->help) {
    std::fputs(DaemonUsage(), stdout);
    return 0;
  }
  const DaemonOptions& o = *options;

  // Signals are taken by sigwait in main; every thread started below inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  Auth auth;
  if (!o.auth_token_file.empty()) {
    absl::StatusOr<Auth> a = Auth::FromFile(o.auth_token_file);
    if (!a.ok()) return Fail(std::string(a.status().message()));
    auth = std::move(*a);
  } else if (!IsLoopbackAddress(o.listen)) {
    return Fail("--listen=" + o.listen + " is not loopback: --auth_token_file is required");
  }

  // Policies are checked before any device is touched: a bad file fails the start, naming its line.
  std::vector<Policy> policies;
  if (!o.policy_file.empty()) {
    std::ifstream in(o.policy_file, std::ios::binary);
    if (!in) return Fail("--policy_file=" + o.policy_file + ": cannot open");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    absl::StatusOr<std::vector<Policy>> parsed = ParsePolicies(text);
    if (!parsed.ok()) return Fail("--policy_file=" + o.policy_file + ": " + std::string(parsed.status().message()));
    policies = std::move(*parsed);
  }

  absl::StatusOr<BackendKind> kind = ParseBackendKind(o.backend);
  if (!kind.ok()) return Fail(std::string(kind.status().message()));
  BackendOptions bo;
  bo.kind = *kind;
  bo.cpu_threads = o.cpu_threads;
  if (Error e = ParseAttentionKernel(o.attention_kernel, &bo.attention_kernel); !e.ok()) return Fail("--" + e.message());
  std::string note;
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(bo, &note);
  if (!backend.ok()) return Fail(std::string(backend.status().message()));
  const KernelInfo kernel = (*backend)->Kernel();
  std::fprintf(stderr, "kvpackd: %s; attention kernel %s%s%s\n", note.c_str(), kernel.attention_kernel.c_str(),
               kernel.compute_capability.empty() ? "" : " on ", kernel.compute_capability.c_str());

  const DeviceMemory dm = (*backend)->QueryDeviceMemory();
  const uint64_t free_bytes = dm.present ? dm.free_bytes : HostAvailableBytes();
  EngineOptions eo;
  FaultInjector faults;  // outlives the engine; consulted only with --fault_every
  if (!o.fault_every.empty()) {
    if (absl::Status s = ApplyFaultEvery(o.fault_every, &faults); !s.ok()) {
      return Fail("--fault_every=" + std::string(s.message()));
    }
    eo.faults = &faults;
    std::fprintf(stderr, "kvpackd: fault injection on (--fault_every=%s): a test hook, not for production\n",
                 o.fault_every.c_str());
  }
  eo.budget_bytes = o.vram_budget.Resolve(free_bytes);
  if (eo.budget_bytes == 0) return Fail("--vram_budget resolves to 0 bytes");
  eo.scheduler.max_queue = static_cast<size_t>(o.max_queue);
  eo.executor_threads = o.threads;
  eo.executor_nice = std::min(o.layer_nice, 19);
  eo.max_chunk_tokens = o.max_chunk_tokens;
  eo.lease = absl::Seconds(o.lease_seconds);
  eo.tenant_quota_bytes = o.tenant_quota.bytes;
  eo.max_inline_bytes_in_flight = o.max_inline_in_flight.Resolve(HostAvailableBytes());
  eo.registry.max_regions = o.max_regions;
  eo.registry.max_regions_per_tenant = o.max_regions_per_tenant;
  eo.registry.max_handles = o.max_handles;
  eo.registry.max_handles_per_tenant = o.max_handles_per_tenant;
  if (o.max_regions > kMaxGuardedRanges) {
    return Fail("--max_regions=" + std::to_string(o.max_regions) + " is above " + std::to_string(kMaxGuardedRanges));
  }
  // Each shared-memory region keeps its object's file descriptor open (every use checks the size):
  // take the hard limit on descriptors, and say so when it is below what --max_regions needs.
  RaiseFileLimit(o.max_regions);
  eo.version = kVersion;
  SystemClock clock;
  Engine engine(eo, std::move(*backend), &clock);
  if (absl::Status s = engine.policies().Add(std::move(policies)); !s.ok()) return Fail(std::string(s.message()));
  ServiceLimits limits;
  limits.max_inline_bytes = o.max_inline.bytes;
  limits.max_chunks_per_call = o.max_chunks_per_call;
  LaneLimits lane_limits;
  lane_limits.max_lanes = o.max_lanes;
  lane_limits.max_lanes_per_tenant = o.max_lanes_per_tenant;
  lane_limits.max_spin_us = static_cast<uint32_t>(o.lane_spin_us);
  KvpackService service(&engine, std::move(auth), limits, lane_limits);

  int metrics_port = 0;
  if (o.metrics_address != "off") {
    absl::StatusOr<int> port = engine.metrics().Serve(o.metrics_address);
    if (!port.ok()) return Fail(std::string(port.status().message()));
    metrics_port = *port;
  }

  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!o.tls_cert_file.empty()) {
    bool ok_cert = false, ok_key = false;
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({ReadFile(o.tls_key_file, &ok_key), ReadFile(o.tls_cert_file, &ok_cert)});
    if (!ok_cert || !ok_key) return Fail("cannot read --tls_cert_file or --tls_key_file");
    creds = grpc::SslServerCredentials(ssl);
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.listen, creds, &port);
  // Large tensors stream in 2 MiB chunks: bigger HTTP/2 frames and a deeper per-stream window keep a
  // 256 MiB upload from being cut into 16 KiB frames behind a 64 KiB window.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  builder.RegisterService(&service);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(NewReflectionAuthInterceptor(&service.auth()));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return Fail("cannot listen on " + o.listen);
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(true);
  std::printf("kvpackd %s: listening on %s (port %d), metrics port %d, backend %s, budget %llu bytes\n", kVersion,
              o.listen.c_str(), port, metrics_port, engine.backend().name().c_str(),
              static_cast<unsigned long long>(eo.budget_bytes));
  std::fflush(stdout);

  // Ticker: queue deadlines, expired leases, sticky backend errors → NOT_SERVING.
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::thread ticker([&] {
    bool serving = true;
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return stop; })) {
      engine.Tick();
      if (serving && !engine.Healthy()) {
        serving = false;
        health->SetServingStatus(false);
        std::fprintf(stderr, "kvpackd: the backend reported a sticky error; health is NOT_SERVING\n");
      }
    }
  });

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "kvpackd: %s: draining (up to %.0f s)\n", sig == SIGTERM ? "SIGTERM" : "SIGINT", o.drain_seconds);
  service.StartDraining();
  health->SetServingStatus(false);
  // Before Shutdown, which waits for every call in flight: queued layers are calls in flight too,
  // and would otherwise all run during the drain (docs/daemon.md, "Shutdown").
  engine.RejectQueued();
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(o.drain_seconds * 1000)));
  service.CloseLanes();  // the lanes saw the drain; each answers its call in flight, then ends
  engine.Drain();
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_all();
  ticker.join();
  server->Wait();
  // Every call has ended, but the last statuses may still be on their way: leaving at once lost one
  // now and then (the client saw UNAVAILABLE, "Connection reset by peer": ~1 of 11 runs of
  // daemon_test's DrainsInFlightWorkOnSigterm under load), and so did a fixed wait of 200 ms, then of
  // 1 s (cancel_test's SigtermFinishesTheRunningLayerAndRejectsQueuedOnes, 2 cores under load,
  // 2026-12-07): the clients must be scheduled to read them. So wait until they hang up (after the
  // GOAWAY of Shutdown a client closes its connection once its calls are done), 3 s at most.
  const int connected = WaitForPeersToHangUp(std::chrono::milliseconds(3000));
  if (connected > 0) std::fprintf(stderr, "kvpackd: %d connection(s) still open after 3 s; closing them\n", connected);
  server.reset();
  std::fprintf(stderr, "kvpackd: drained; exiting\n");
  // Every call has finished and every job has run; the pool and mappings go with the process. The
  // metrics server (civetweb) and gRPC's static teardown would take ~2 s more to stop their
  // threads, so leave without running destructors.
  std::fflush(nullptr);
  _exit(0);
}

}  // namespace
}  // namespace kvpack::server

int main(int argc, char** argv) { return kvpack::server::Main(argc, argv); }
