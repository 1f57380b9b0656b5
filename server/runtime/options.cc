#include "server/runtime/options.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvpack::server {

const char* DaemonUsage() {
  return R"(kvpackd: the kvpack attention daemon

  --listen=ADDR            gRPC address, host:port or unix:PATH (default 127.0.0.1:50051; port 0 picks one)
  --metrics_address=ADDR   Prometheus /metrics address (default 127.0.0.1:9464; "off" disables)
  --vram_budget=SIZE       pool budget: bytes (K M G T, Ki Mi Gi Ti suffixes) or a fraction of free memory (0.8)
  --backend=auto|cpu|cuda  engine; auto and cuda fall back to cpu when no CUDA device answers (default auto)
  --attention_kernel=auto|wgmma|mma_sync  CUDA attention kernel: auto (wgmma on H100/H200, mma_sync
                           elsewhere), or force one; a forced kernel the GPU cannot run stops the start
  --auth_token_file=F      bearer tokens, one per line "TOKEN [TENANT]"; required off loopback
  --tls_cert_file=F --tls_key_file=F   serve TLS
  --threads=N              layers run at once on the daemon's executor (default 2)
  --cpu_threads=N          threads per layer on the CPU backend (default 0: all cores)
  --max_queue=N            requests that may wait for memory (default 64)
  --max_chunk_tokens=N     largest projection/query chunk the planner picks (default 16384; smaller
                           chunks stop sooner on cancel and interleave layers more finely)
  --lease_seconds=S        handles and regions are released S seconds after last use (default 600)
  --tenant_quota=SIZE      pool bytes one tenant may hold (default 0: none)
  --max_inline_bytes=SIZE  inline tensor bytes per request (default 16Gi)
  --max_inline_bytes_in_flight=SIZE   host bytes of inline tensors of all calls at once: bytes or a
                           fraction of MemAvailable at start (default 0.5)
  --max_chunks_per_call=N  messages one streamed upload may send (default 65536)
  --max_regions=N          registered regions, all tenants (default 4096)
  --max_regions_per_tenant=N   registered regions of one tenant (default 1024)
  --max_handles=N          weights and K/V handles, all tenants (default 65536)
  --max_handles_per_tenant=N   weights and K/V handles of one tenant (default 4096)
  --max_lanes=N            lanes (OpenLane: same-host calls through shared memory), all tenants; each is a
                           thread (default 8; 0: no lanes)
  --max_lanes_per_tenant=N lanes of one tenant (default 2)
  --lane_spin_us=N         how long a lane thread spins for the next call after an answer before it sleeps
                           (a CPU core busy meanwhile; the default and the most a client may ask for;
                           default 20000, at most 1000000; 0: sleep at once)
  --layer_nice=N           nice value (0-19) of the threads that run layers, so RPCs such as Status
                           are not starved by CPU layer work (default 10)
  --drain_seconds=S        on SIGTERM/SIGINT, time in-flight calls get to finish (default 30)
  --policy_file=F          precision policies by block, timestep and range role (docs/policies.md)
  --fault_every=SITE:N[,SITE:N]  test hook, never for production: fail every N-th call at SITE
                           (host_alloc, vmm_map, shm_map, device_call; docs/reliability.md) (default off)
)";
}

absl::StatusOr<DaemonOptions> ParseDaemonOptions(int argc, char** argv) {
  DaemonOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      o.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) return absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", arg, "\""));
    std::string name, value;
    const std::string bare = arg.substr(2, arg.find('=') == std::string::npos ? std::string::npos : arg.find('=') - 2);
    static const char* const kKnown[] = {"listen", "metrics_address", "vram_budget", "backend", "attention_kernel", "auth_token_file",
                                         "tls_cert_file", "tls_key_file", "threads", "cpu_threads", "max_queue",
                                         "max_chunk_tokens", "lease_seconds", "tenant_quota", "max_inline_bytes",
                                         "drain_seconds", "max_inline_bytes_in_flight", "max_chunks_per_call",
                                         "max_regions", "max_regions_per_tenant", "layer_nice",
                                         "max_handles", "max_handles_per_tenant", "policy_file", "fault_every",
                                         "max_lanes", "max_lanes_per_tenant", "lane_spin_us"};
    if (std::find(std::begin(kKnown), std::end(kKnown), bare) == std::end(kKnown)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", bare, " (see --help)"));
    }
    if (auto eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(2, eq - 2);
      value = arg.substr(eq + 1);
    } else {
      name = arg.substr(2);
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      value = argv[++i];
    }
    const auto bad = [&](const char* what) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", value, ": ", what));
    };
    const auto to_int = [&](int* out, int lo) -> absl::Status {
      if (!absl::SimpleAtoi(value, out) || *out < lo) return bad("expected an integer");
      return absl::OkStatus();
    };
    const auto to_double = [&](double* out) -> absl::Status {
      if (!absl::SimpleAtod(value, out) || !(*out > 0)) return bad("expected a positive number");
      return absl::OkStatus();
    };
    const auto to_size = [&](ByteSize* out, bool allow_zero) -> absl::Status {
      if (allow_zero && value == "0") {
        *out = ByteSize{};
        return absl::OkStatus();
      }
      absl::StatusOr<ByteSize> s = ParseByteSize(value);
      if (!s.ok()) return s.status();
      *out = *s;
      return absl::OkStatus();
    };
    absl::Status s;
    if (name == "listen") o.listen = value;
    else if (name == "metrics_address") o.metrics_address = value;
    else if (name == "vram_budget") s = to_size(&o.vram_budget, false);
    else if (name == "backend") o.backend = value;
    else if (name == "attention_kernel") o.attention_kernel = value;
    else if (name == "auth_token_file") o.auth_token_file = value;
    else if (name == "tls_cert_file") o.tls_cert_file = value;
    else if (name == "tls_key_file") o.tls_key_file = value;
    else if (name == "policy_file") o.policy_file = value;
    else if (name == "fault_every") o.fault_every = value;
    else if (name == "threads") s = to_int(&o.threads, 1);
    else if (name == "cpu_threads") s = to_int(&o.cpu_threads, 0);
    else if (name == "max_queue") s = to_int(&o.max_queue, 1);
    else if (name == "max_chunk_tokens") s = to_int(&o.max_chunk_tokens, 64);
    else if (name == "lease_seconds") s = to_double(&o.lease_seconds);
    else if (name == "tenant_quota") s = to_size(&o.tenant_quota, true);
    else if (name == "max_inline_bytes") s = to_size(&o.max_inline, false);
    else if (name == "drain_seconds") s = to_double(&o.drain_seconds);
    else if (name == "max_inline_bytes_in_flight") s = to_size(&o.max_inline_in_flight, false);
    else if (name == "max_chunks_per_call") s = to_int(&o.max_chunks_per_call, 1);
    else if (name == "max_regions") s = to_int(&o.max_regions, 1);
    else if (name == "max_regions_per_tenant") s = to_int(&o.max_regions_per_tenant, 1);
    else if (name == "layer_nice") s = to_int(&o.layer_nice, 0);
    else if (name == "max_handles") s = to_int(&o.max_handles, 1);
    else if (name == "max_handles_per_tenant") s = to_int(&o.max_handles_per_tenant, 1);
    else if (name == "max_lanes") s = to_int(&o.max_lanes, 0);
    else if (name == "max_lanes_per_tenant") s = to_int(&o.max_lanes_per_tenant, 1);
    else if (name == "lane_spin_us") {
      s = to_int(&o.lane_spin_us, 0);
      if (s.ok() && o.lane_spin_us > 1000000) s = bad("at most 1000000 (1 s)");
    }
    else return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    if (!s.ok()) return s;
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file go together");
  }
  return o;
}

bool IsLoopbackAddress(const std::string& address) {
  if (address.rfind("unix:", 0) == 0) return true;
  std::string host = address.substr(0, address.rfind(':'));
  if (host.rfind("ipv4:", 0) == 0) host = host.substr(5);
  return host == "localhost" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

}  // namespace kvpack::server
