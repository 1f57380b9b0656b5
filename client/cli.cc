// kvpack: command-line client of kvpackd.
//
//   kvpack --server ADDR [--token_file F] [--tenant T] [--timeout S] [--tls_ca_file F] COMMAND [flags]
//   COMMAND: health | status | plan | run | bench
//   layer flags (plan, run, bench): --tokens N --hidden D --heads H --head_dim d
//     --ranges "LEN:FMT|FMT[@SEQ],…" --causal --rope --qk_norm --bias --seed S --priority P --keep_kv
//     --sparse topk=R|tau=T --no_tail --sink_pages K --min_exact_pages K (block-sparse attention)
//   bench flags: --iterations N --concurrency C --transfer_mib M (inline upload throughput only)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client.h"
#include "client/synthetic.h"

namespace kvpack::client {
namespace {

constexpr char kUsage[] = R"(usage: kvpack --server ADDR [--token_file F] [--tenant T] [--timeout S] [--tls_ca_file F] COMMAND [flags]
commands:
  health   grpc.health.v1 status of the daemon (exit 0 when SERVING)
  status   attention kernel and GPU arch, budget, pool by state and format, high-water, queue, this tenant's use
  plan     the daemon's plan for a synthetic layer (formats, chunks, bytes) or why it does not fit
  run      run a synthetic layer; report time, peak pool bytes and error vs the local CPU reference
  bench    repeated or concurrent layers: progress, latency percentiles (--transfer_mib: upload GB/s)
layer flags: --tokens N (1000) --hidden D (256) --heads H (4) --head_dim d (64)
  --ranges "LEN:FMT|FMT[@SEQ],..." (one range, int8|int4) --causal --rope --qk_norm --bias --seed S
  --priority P --keep_kv
  --mma auto|bf16|int8 (tensor-core arithmetic of the attention)
  --sparse topk=R|tau=T (block-sparse attention) --no_tail --sink_pages K --min_exact_pages K
bench flags: --iterations N (8) --concurrency C (1) --transfer_mib M (inline upload GB/s)
  --rpc plan|status (round-trip latency of Plan for the layer flags, or of Status)
)";

struct Args {
  ClientOptions client;
  std::string command;
  SyntheticSpec spec;
  std::string ranges;
  int priority = 0;
  bool keep_kv = false;
  int iterations = 8;
  int concurrency = 1;
  int transfer_mib = 0;
  std::string rpc;  // bench --rpc plan|status: round-trip latency of a small RPC
};

int Usage(const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "kvpack: %s\n", error.c_str());
  std::fputs(kUsage, stderr);
  return 2;
}

bool ParseArgs(int argc, char** argv, Args* a, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      if (!a->command.empty()) {
        *error = "unexpected argument " + arg;
        return false;
      }
      a->command = arg;
      continue;
    }
    std::string name = arg.substr(2), value;
    const bool is_switch = name == "causal" || name == "rope" || name == "qk_norm" || name == "bias" || name == "keep_kv" ||
                           name == "no_tail";
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (!is_switch) {
      if (i + 1 >= argc) {
        *error = "--" + name + " needs a value";
        return false;
      }
      value = argv[++i];
    }
    bool ok = true;
    int64_t n = 0;
    const auto num = [&](auto* out) {
      ok = absl::SimpleAtoi(value, &n);
      *out = static_cast<std::remove_pointer_t<decltype(out)>>(n);
    };
    if (name == "server") a->client.address = value;
    else if (name == "token_file") {
      std::ifstream in(value);
      ok = static_cast<bool>(std::getline(in, a->client.token));
      a->client.token = a->client.token.substr(0, a->client.token.find_first_of(" \t#"));
    } else if (name == "tenant") a->client.tenant = value;
    else if (name == "tls_ca_file") a->client.tls_ca_file = value;
    else if (name == "timeout") {
      double s = 0;
      ok = absl::SimpleAtod(value, &s) && s > 0;
      a->client.timeout = absl::Seconds(s);
    } else if (name == "tokens") num(&a->spec.n_tokens);
    else if (name == "hidden") num(&a->spec.hidden);
    else if (name == "heads") num(&a->spec.n_heads);
    else if (name == "head_dim") num(&a->spec.head_dim);
    else if (name == "seed") num(&a->spec.seed);
    else if (name == "ranges") a->ranges = value;
    else if (name == "causal") a->spec.causal = true;
    else if (name == "mma") {
      if (value == "auto") a->spec.mma = MmaPath::kAuto;
      else if (value == "bf16") a->spec.mma = MmaPath::kBf16;
      else if (value == "int8") a->spec.mma = MmaPath::kInt8;
      else ok = false;
    }
    else if (name == "rope") a->spec.rope = true;
    else if (name == "qk_norm") a->spec.qk_norm = true;
    else if (name == "bias") a->spec.bias = true;
    else if (name == "keep_kv") a->keep_kv = true;
    else if (name == "priority") num(&a->priority);
    else if (name == "iterations") num(&a->iterations);
    else if (name == "concurrency") num(&a->concurrency);
    else if (name == "transfer_mib") num(&a->transfer_mib);
    else if (name == "rpc") a->rpc = value;
    else if (name == "sparse") {
      double x = 0;
      a->spec.sparse.enabled = true;
      if (value.rfind("topk=", 0) == 0 && absl::SimpleAtod(value.substr(5), &x)) {
        a->spec.sparse.mode = SparseMode::kTopK;
        a->spec.sparse.topk_ratio = static_cast<float>(x);
      } else if (value.rfind("tau=", 0) == 0 && absl::SimpleAtod(value.substr(4), &x)) {
        a->spec.sparse.mode = SparseMode::kRelTau;
        a->spec.sparse.rel_tau = static_cast<float>(x);
      } else {
        ok = false;
      }
    } else if (name == "no_tail") a->spec.sparse.tail = false;
    else if (name == "sink_pages") num(&a->spec.sparse.sink_pages);
    else if (name == "min_exact_pages") num(&a->spec.sparse.min_exact_pages);
    else {
      *error = "unknown flag --" + name;
      return false;
    }
    if (!ok) {
      *error = "bad value for --" + name + ": " + value;
      return false;
    }
  }
  if (a->command.empty()) {
    *error = "no command";
    return false;
  }
  if (!a->ranges.empty()) {
    absl::StatusOr<std::vector<SyntheticRange>> r = ParseRanges(a->ranges, a->spec.n_tokens);
    if (!r.ok()) {
      *error = std::string(r.status().message());
      return false;
    }
    a->spec.ranges = *r;
  }
  return true;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvpack: %s\n", s.ToString().c_str());
  return 1;
}

std::string Bytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return absl::StrCat(b, " (", absl::StrFormat("%.2f", v), " ", units[u], ")");
}

const char* FormatText(v1::Format f) {
  return f == v1::FORMAT_INT4 ? "int4" : f == v1::FORMAT_INT8 ? "int8" : f == v1::FORMAT_BF16 ? "bf16" : "?";
}

void PrintPlan(const v1::PlanResult& p, const v1::LayerHeader& h) {
  for (int i = 0; i < p.ranges_size(); ++i) {
    const v1::TokenRange& r = h.ranges(i);
    std::printf("  range %d [%lld, %lld) seq %d: %s%s\n", i, static_cast<long long>(r.begin()),
                static_cast<long long>(r.end()), r.seq_id(), FormatText(p.ranges(i).format()),
                p.ranges(i).downgraded() ? " (downgraded)" : "");
  }
  std::printf("  chunks: projection %lld, query %lld tokens\n", static_cast<long long>(p.projection_chunk()),
              static_cast<long long>(p.query_chunk()));
  std::printf("  bytes: kv %s, workspace %s, io %s\n", Bytes(p.kv_bytes()).c_str(), Bytes(p.workspace_bytes()).c_str(),
              Bytes(p.io_bytes()).c_str());
  std::printf("  predicted peak %s of capacity %s; downgrades %d\n", Bytes(p.predicted_peak_bytes()).c_str(),
              Bytes(p.capacity_bytes()).c_str(), p.downgrades());
  if (p.routing_bytes() > 0) {
    std::printf("  sparse: routing %s (in workspace), routed fraction at most %.3f\n", Bytes(p.routing_bytes()).c_str(),
                p.routed_fraction_bound());
  }
}

absl::StatusOr<std::string> Register(Client& c, const SyntheticLayer& L) {
  absl::StatusOr<v1::WeightsResponse> r = c.RegisterWeights(WeightsOf(L));
  if (!r.ok()) return r.status();
  return r->handle();
}

int Health(Client& c) {
  absl::StatusOr<bool> serving = c.Health();
  if (!serving.ok()) return Fail(serving.status());
  std::printf("%s\n", *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? 0 : 1;
}

int Status(Client& c) {
  absl::StatusOr<v1::StatusResponse> s = c.Status();
  if (!s.ok()) return Fail(s.status());
  std::printf("kvpackd %s, backend %s, %s\n", s->version().c_str(), s->backend().c_str(),
              s->serving() ? "serving" : "NOT serving");
  if (s->compute_capability().empty()) {
    std::printf("kernel        %s\n", s->attention_kernel().c_str());
  } else {
    std::printf("kernel        %s on %s, %d SMs (binary: %s)\n", s->attention_kernel().c_str(),
                s->compute_capability().c_str(), s->sm_count(), s->cuda_archs_built().c_str());
  }
  std::printf("budget        %s\n", Bytes(s->budget_bytes()).c_str());
  std::printf("pool          %s (high-water %s, mapped %s, reserved %s)\n", Bytes(s->pool_bytes()).c_str(),
              Bytes(s->high_water_bytes()).c_str(), Bytes(s->mapped_bytes()).c_str(), Bytes(s->reserved_bytes()).c_str());
  std::printf("  kv_active   %s\n  kv_kept     %s\n  weights     %s\n  workspace   %s\n",
              Bytes(s->kv_active_bytes()).c_str(), Bytes(s->kv_kept_bytes()).c_str(), Bytes(s->weights_bytes()).c_str(),
              Bytes(s->workspace_bytes()).c_str());
  std::printf("  int4 %s, int8 %s, bf16 %s\n", Bytes(s->int4_bytes()).c_str(), Bytes(s->int8_bytes()).c_str(),
              Bytes(s->bf16_bytes()).c_str());
  std::printf("queue         %d waiting (max %d), %d running\n", s->queue_depth(), s->max_queue(), s->running());
  std::printf("handles       %d weights, %d kv; regions %d shm, %d cuda_ipc\n", s->weights_handles(), s->kv_handles(),
              s->shm_regions(), s->cuda_ipc_regions());
  const v1::TenantUsage& t = s->tenant();
  std::printf("tenant %s:   %s, %d weights, %d kv, %d regions, %d queued, %d running%s\n", t.tenant().c_str(),
              Bytes(t.pool_bytes()).c_str(), t.weights_handles(), t.kv_handles(), t.regions(), t.queued(), t.running(),
              t.quota_bytes() ? absl::StrCat(", quota ", Bytes(t.quota_bytes())).c_str() : "");
  return 0;
}

int Plan(Client& c, const Args& a) {
  const SyntheticLayer L = MakeSyntheticLayer(a.spec);
  v1::PlanRequest req;
  *req.mutable_header() = L.header;
  req.set_has_bias(a.spec.bias);
  if (a.spec.qk_norm) req.mutable_header()->mutable_options()->mutable_qk_norm()->set_weight_len(a.spec.head_dim);
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<v1::PlanResponse> p = c.Plan(req);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!p.ok()) return Fail(p.status());
  std::printf("plan for N=%lld D=%d H=%d d=%d (round trip %.3f ms): %s\n", static_cast<long long>(a.spec.n_tokens),
              a.spec.hidden, a.spec.n_heads, a.spec.head_dim, ms, p->fits() ? "fits" : "does NOT fit");
  PrintPlan(p->plan(), L.header);
  if (!p->fits()) std::printf("  reason: %s\n", p->reason().c_str());
  return p->fits() ? 0 : 1;
}

int Run(Client& c, const Args& a) {
  const SyntheticLayer L = MakeSyntheticLayer(a.spec);
  absl::StatusOr<std::string> handle = Register(c, L);
  if (!handle.ok()) return Fail(handle.status());
  v1::LayerHeader h = L.header;
  h.set_weights_handle(*handle);
  h.set_keep_kv(a.keep_kv);
  h.set_priority(a.priority);
  std::vector<uint16_t> out(L.out_bytes() / 2);
  LayerData data{L.x.data(), L.positions.empty() ? nullptr : L.positions.data(), out.data(), L.out_bytes()};
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<v1::LayerResult> r = c.AttentionLayer(h, data);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!r.ok()) {
    (void)c.ReleaseWeights(*handle);
    return Fail(r.status());
  }
  std::printf("run N=%lld D=%d H=%d d=%d: %.3f s wall (queue %.3f, project %.3f, attend %.3f, upload %.3f)\n",
              static_cast<long long>(a.spec.n_tokens), a.spec.hidden, a.spec.n_heads, a.spec.head_dim, seconds,
              r->seconds().queue(), r->seconds().project(), r->seconds().attend(), r->seconds().transfer());
  PrintPlan(r->plan(), h);
  std::printf("  peak pool bytes %s (predicted %s)\n", Bytes(r->peak_bytes()).c_str(),
              Bytes(r->plan().predicted_peak_bytes()).c_str());
  if (!r->kv_handle().empty()) std::printf("  kept K/V: %s\n", r->kv_handle().c_str());
  if (a.spec.sparse.enabled) std::printf("  sparse: routed_fraction %.4f\n", r->routed_fraction());
  // A run that reports an estimate made the per-head choice (either backend, by default); one that
  // reports none kept every transform.
  absl::StatusOr<std::vector<uint16_t>> ref = ReferenceOutput(L, r->plan(), r->has_estimated_rel_error());
  if (!ref.ok()) return Fail(ref.status());
  const Comparison cmp = Compare(out, *ref);
  std::printf("  vs local CPU reference: max |err| %.3g, rel L2 %.3g%s\n", cmp.max_abs, cmp.rel_l2,
              cmp.identical ? " (bit-identical)" : "");
  if (!r->kv_handle().empty()) (void)c.ReleaseKv(r->kv_handle());
  (void)c.ReleaseWeights(*handle);
  return 0;
}

int TransferBench(Client& c, const Args& a) {
  // A weights upload of about transfer_mib MiB: w_qkv [3·H·d, D] with H = 32, d = 128.
  const int heads = 32, d = 128;
  const uint64_t row_bytes = 3ull * heads * d * 2;
  const int hidden = static_cast<int>((static_cast<uint64_t>(a.transfer_mib) << 20) / row_bytes);
  std::vector<uint16_t> w(3ull * heads * d * hidden);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(0x3c00 + (i * 2654435761u >> 20) % 512);
  double best = 0;
  for (int i = 0; i < std::max(1, a.iterations); ++i) {
    WeightsData wd{hidden, heads, d, w.data(), nullptr, nullptr, nullptr, 0};
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<v1::WeightsResponse> r = c.RegisterWeights(wd);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.ok()) return Fail(r.status());
    (void)c.ReleaseWeights(r->handle());
    const double gbs = static_cast<double>(w.size() * 2) / s / 1e9;
    best = std::max(best, gbs);
    std::printf("inline upload of %.1f MiB: %.3f s, %.2f GB/s\n", static_cast<double>(w.size() * 2) / (1 << 20), s, gbs);
  }
  std::printf("best %.2f GB/s\n", best);
  return 0;
}

int RpcBench(Client& c, const Args& a) {
  const SyntheticLayer L = MakeSyntheticLayer(a.spec);
  v1::PlanRequest req;
  *req.mutable_header() = L.header;
  req.set_has_bias(a.spec.bias);
  if (a.spec.qk_norm) req.mutable_header()->mutable_options()->mutable_qk_norm()->set_weight_len(a.spec.head_dim);
  std::vector<double> ms;
  for (int i = 0; i < std::max(1, a.iterations); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status s = a.rpc == "plan" ? c.Plan(req).status() : c.Status().status();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (!s.ok()) return Fail(s);
  }
  std::sort(ms.begin(), ms.end());
  const auto pct = [&](double p) { return ms[std::min(ms.size() - 1, static_cast<size_t>(p * (ms.size() - 1) + 0.5))]; };
  std::printf("%s round trip over %zu calls: p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, min %.3f ms\n", a.rpc.c_str(),
              ms.size(), pct(0.5), pct(0.9), pct(0.99), ms.front());
  return 0;
}

int Bench(Client& c, const Args& a) {
  if (a.transfer_mib > 0) return TransferBench(c, a);
  if (a.rpc == "plan" || a.rpc == "status") return RpcBench(c, a);
  if (!a.rpc.empty()) return Usage("--rpc takes plan or status");
  const SyntheticLayer L = MakeSyntheticLayer(a.spec);
  absl::StatusOr<std::string> handle = Register(c, L);
  if (!handle.ok()) return Fail(handle.status());
  v1::LayerHeader h = L.header;
  h.set_weights_handle(*handle);
  h.set_priority(a.priority);
  std::atomic<int> next{0}, failed{0};
  std::mutex mu;
  std::vector<double> latencies;
  std::map<std::string, int> errors;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < std::max(1, a.concurrency); ++t) {
    threads.emplace_back([&] {
      std::vector<uint16_t> out(L.out_bytes() / 2);
      while (next.fetch_add(1) < a.iterations) {
        LayerData data{L.x.data(), L.positions.empty() ? nullptr : L.positions.data(), out.data(), L.out_bytes()};
        const auto t0 = std::chrono::steady_clock::now();
        absl::StatusOr<v1::LayerResult> r = c.AttentionLayer(h, data);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::lock_guard<std::mutex> lock(mu);
        if (r.ok()) {
          latencies.push_back(s);
        } else {
          ++failed;
          ++errors[absl::StatusCodeToString(r.status().code())];
        }
        const int done = static_cast<int>(latencies.size()) + failed.load();
        const int width = 40, filled = width * done / std::max(1, a.iterations);
        std::fprintf(stderr, "\r[%s%s] %d/%d", std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                     done, a.iterations);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "\n");
  (void)c.ReleaseWeights(*handle);
  std::sort(latencies.begin(), latencies.end());
  const auto pct = [&](double p) {
    if (latencies.empty()) return 0.0;
    return latencies[std::min(latencies.size() - 1, static_cast<size_t>(p * (latencies.size() - 1) + 0.5))];
  };
  std::printf("bench N=%lld D=%d H=%d d=%d: %zu ok, %d failed, concurrency %d, %.3f s wall, %.2f layers/s\n",
              static_cast<long long>(a.spec.n_tokens), a.spec.hidden, a.spec.n_heads, a.spec.head_dim, latencies.size(),
              failed.load(), a.concurrency, wall, static_cast<double>(latencies.size()) / wall);
  std::printf("latency p50 %.4f s, p90 %.4f s, p99 %.4f s, max %.4f s\n", pct(0.5), pct(0.9), pct(0.99), pct(1.0));
  for (const auto& [code, n] : errors) std::printf("  %s: %d\n", code.c_str(), n);
  return failed.load() == 0 ? 0 : 1;
}

int Main(int argc, char** argv) {
  Args a;
  std::string error;
  if (!ParseArgs(argc, argv, &a, &error)) return Usage(error);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(a.client);
  if (!c.ok()) return Fail(c.status());
  if (a.command == "health") return Health(**c);
  if (a.command == "status") return Status(**c);
  if (a.command == "plan") return Plan(**c, a);
  if (a.command == "run") return Run(**c, a);
  if (a.command == "bench") return Bench(**c, a);
  return Usage("unknown command " + a.command);
}

}  // namespace
}  // namespace kvpack::client

int main(int argc, char** argv) { return kvpack::client::Main(argc, argv); }
