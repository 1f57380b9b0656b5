// Test helper: the daemon's parts (Engine on the CPU backend, KvpackService) serving on a loopback
// port inside the test process, so a test can inject faults (EngineOptions::faults) and read the
// pool directly while a real client talks gRPC to it.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "client/client.h"
#include "server/backends/cpu_backend.h"
#include "server/core/fault_injector.h"
#include "server/service/service.h"

namespace kvpack::testing {

class InProcessDaemon {
 public:
  explicit InProcessDaemon(server::FaultInjector* faults, uint64_t budget_bytes = 64ull << 20) {
    server::EngineOptions eo;
    eo.budget_bytes = budget_bytes;
    eo.faults = faults;
    eo.max_chunk_tokens = 128;  // several chunks per call, so cancellation between chunks is reachable
    engine_ = std::make_unique<server::Engine>(eo, server::MakeCpuBackend(1), &clock_);
    service_ = std::make_unique<server::KvpackService>(engine_.get(), server::Auth(), server::ServiceLimits());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
  }
  ~InProcessDaemon() {
    server_->Shutdown();
    engine_->Drain();
  }

  bool ok() const { return server_ != nullptr && port_ > 0; }
  server::Engine& engine() { return *engine_; }
  std::unique_ptr<client::Client> Connect() const {
    client::ClientOptions o;
    o.address = "127.0.0.1:" + std::to_string(port_);
    o.timeout = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(o);
    return c.ok() ? std::move(*c) : nullptr;
  }
  // Whether the pool holds nothing (no allocation, no reservation) within `wait` (a finished call's
  // reactor lets go of its job just after the client sees the status).
  bool PoolEmptyWithin(std::chrono::milliseconds wait) {
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      const server::PoolSnapshot s = engine_->pool().Snapshot();
      if (s.allocated == 0 && s.reserved == 0) return true;
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

 private:
  server::SystemClock clock_;
  std::unique_ptr<server::Engine> engine_;
  std::unique_ptr<server::KvpackService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace kvpack::testing
