// kvpackd's command line (plain argv parsing: --name=value or --name value).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/core/byte_size.h"

namespace kvpack::server {

struct DaemonOptions {
  std::string listen = "127.0.0.1:50051";        // host:port or unix:PATH
  std::string metrics_address = "127.0.0.1:9464";  // host:port; "off" disables
  ByteSize vram_budget{0, 0.8, true};              // bytes or a fraction of free memory
  std::string backend = "auto";                    // auto | cpu | cuda
  std::string attention_kernel = "auto";           // auto | wgmma | mma_sync (kernels/kernel_choice.h)
  std::string auth_token_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string policy_file;         // precision policies loaded at start (docs/policies.md)
  int threads = 2;                 // executor threads (layers running at once)
  int cpu_threads = 0;             // threads per CPU layer; 0: all cores
  int max_queue = 64;
  int max_chunk_tokens = 16384;    // cap on the planner's chunk sizes
  double lease_seconds = 600;      // handles and regions expire this long after last use
  ByteSize tenant_quota{0, 0, false};
  ByteSize max_inline{16ull << 30, 0, false};
  ByteSize max_inline_in_flight{0, 0.5, true};  // all calls' inline tensors: bytes or a fraction of MemAvailable
  int max_chunks_per_call = 65536;
  int max_regions = 4096;
  int max_regions_per_tenant = 1024;
  int max_handles = 65536;
  int max_handles_per_tenant = 4096;
  int max_lanes = 8;               // server/service/lane.h
  int max_lanes_per_tenant = 2;
  int lane_spin_us = 20000;
  int layer_nice = 10;             // nice value of the executor threads (0..19)
  double drain_seconds = 30;       // SIGTERM: how long in-flight calls may take to finish
  std::string fault_every;         // test hook: "SITE:N,..." fails every N-th call at SITE (fault_injector.h)
  bool help = false;
};

absl::StatusOr<DaemonOptions> ParseDaemonOptions(int argc, char** argv);
const char* DaemonUsage();

// True for 127.0.0.0/8, localhost, [::1] and unix: addresses.
bool IsLoopbackAddress(const std::string& address);

}  // namespace kvpack::server
