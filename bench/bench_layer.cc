// bench_layer: one attention layer of the CUDA engine on seeded inputs (bench_inputs.h).
//
//   bench_layer --n=32768 --hidden=7168 --heads=56 --dim=128 --format=int4 [--in_place=1] [--reps=3]
//               [--tp=4096] [--tq=4096] [--tiling=auto|mma_sync|tall|wide|wgmma] [--mma=auto|bf16|int8]
//               [--rows_out=/tmp/rows.bin] [--gemm=1]
//               [--digest=1] [--choose_per_head=1] [--topk=0.2 [--sinks=1] [--text=0] [--tail=1]]
//
// Prints one JSON line: median layer time over --reps timed runs (inputs refilled before each, so an
// in-place run never reads its own output), per-stage times of one instrumented run, attention
// TFLOP/s (4·N²·d per head), bytes the layer allocates (K/V block + workspace + output unless in
// place) and the device-memory drop measured around those allocations, and (--gemm) the times of the
// unchunked cuBLASLt GEMMs x·W_{k,v}ᵀ and x·W_qkvᵀ for comparison with the streamed projection (its K/V
// part: projection_ms; all of it, Q included: projection_all_ms). --rows_out writes
// 64 evenly spaced output rows (bf16 [64, H·d]) for torch_baseline.py's error check. --digest adds
// FNV-1a digests of the packed K/V block and the whole output of the instrumented run (kv_digest,
// out_digest), so that two builds that must agree bit for bit can be compared at full size.
// --choose_per_head (default 1, as a request's TransformOptions) runs the per-head transform choice
// (kernels/cuda/head_choice.h): its time shows in stats_ms; 0 keeps every transform, the layer of
// trees that predate the choice.
// --topk runs the block-sparse path (kernels/cuda/sparse.h) with that top-k ratio, --sinks leading
// pages always exact, --text leading tokens in an always-attended range and --tail=0 no pooled term
// (the exact pages alone: what the pooled pass costs is the difference); attention_tflops is then
// the dense-equivalent rate (4·N²·d per head over the sparse time) and routed_fraction is printed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_inputs.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/layer.h"

namespace {

std::map<std::string, std::string> ParseArgs(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    const size_t eq = a.find('=');
    args[a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2)] =
        eq == std::string::npos ? "1" : a.substr(eq + 1);
  }
  return args;
}

#define CHECK_CUDA(call)                                                                    \
  do {                                                                                      \
    const cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)
#define CHECK_OK(expr)                                                        \
  do {                                                                        \
    const kvpack::Error e_ = (expr);                                          \
    if (!e_.ok()) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, e_.message().c_str()); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

uint64_t DeviceDigest(const void* device, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  if (cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, 64 bits
  for (uint8_t b : host) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvpack;
  auto args = ParseArgs(argc, argv);
  auto get = [&](const char* k, const char* def) { return args.count(k) ? args[k] : std::string(def); };
  const int64_t n = std::stoll(get("n", "8192"));
  const int hidden = std::stoi(get("hidden", "7168")), heads = std::stoi(get("heads", "56")), dim = std::stoi(get("dim", "128"));
  const std::string fmt = get("format", "int4");
  const bool in_place = get("in_place", "0") == "1";
  const int reps = std::stoi(get("reps", "3"));
  const std::string rows_out = get("rows_out", "");
  const PageFormat format = fmt == "int8" ? PageFormat::kInt8 : fmt == "bf16" ? PageFormat::kBf16 : PageFormat::kInt4;
  const int64_t hd = static_cast<int64_t>(heads) * dim;

  LayerConfig config;
  config.shape = {n, hidden, heads, dim};
  config.ranges = {{0, n, 0, format}};
  config.projection_chunk = std::stoll(get("tp", "4096"));
  // 33 query tiles: launches of whole waves on the H200's 132 SMs at 56 or 112 heads (AttentionWaveRows;
  // the layer runs a smaller chunk as it is, so 4096 would leave its last wave 58% idle).
  config.query_chunk = std::stoll(get("tq", "4224"));
  config.in_place = in_place;
  config.transforms.choose_per_head = get("choose_per_head", "1") != "0";
  const std::string mma = get("mma", "auto");
  config.attention.mma = mma == "int8" ? MmaPath::kInt8 : mma == "bf16" ? MmaPath::kBf16 : MmaPath::kAuto;
  const std::string topk = get("topk", "");
  if (!topk.empty()) {
    config.attention.sparse.enabled = true;
    config.attention.sparse.topk_ratio = std::stof(topk);
    config.attention.sparse.sink_pages = std::stoi(get("sinks", "1"));
    config.attention.sparse.tail = get("tail", "1") != "0";
    const int64_t text = std::stoll(get("text", "0"));
    if (text > 0) config.ranges = {{0, text, 0, format, /*always_attend=*/true}, {text, n, 0, format}};
  }
  CHECK_OK(cuda::Supported(config));

  cuda::CudaContext ctx;
  std::string tiling = get("tiling", "auto");
  ctx.attention_tiling = tiling == "wide"    ? cuda::AttentionTilingChoice::kWide
                         : tiling == "tall"  ? cuda::AttentionTilingChoice::kTall
                         : tiling == "wgmma" ? cuda::AttentionTilingChoice::kWgmma
                         : tiling == "mma_sync" ? cuda::AttentionTilingChoice::kMmaSync
                                             : cuda::AttentionTilingChoice::kAuto;
  cuda::AttentionTilingChoice resolved;
  MmaPath mma_path;
  CHECK_OK(cuda::ResolveLayerKernel(config, ctx.attention_tiling, &resolved, &mma_path));
  if (ctx.attention_tiling == cuda::AttentionTilingChoice::kAuto ||
      ctx.attention_tiling == cuda::AttentionTilingChoice::kMmaSync) {
    tiling += resolved == cuda::AttentionTilingChoice::kWide    ? ":wide"
              : resolved == cuda::AttentionTilingChoice::kWgmma ? ":wgmma"
                                                                : ":tall";
  }
  CHECK_CUDA(cudaStreamCreate(&ctx.stream));
  if (cublasLtCreate(&ctx.blas) != CUBLAS_STATUS_SUCCESS) return 1;

  // ── Inputs (not counted) ──────────────────────────────────────────────────────────────────────
  uint16_t *x = nullptr, *w = nullptr;
  CHECK_CUDA(cudaMalloc(&x, n * hidden * 2));
  CHECK_CUDA(cudaMalloc(&w, 3 * hd * hidden * 2));
  auto refill = [&] { CHECK_CUDA(bench::FillInputs(x, n, hidden, w, 3 * hd, hd, ctx.stream)); };
  refill();
  CHECK_CUDA(cudaStreamSynchronize(ctx.stream));

  // ── The layer's own allocations: the high-water mark above the inputs ─────────────────────────
  size_t free_before = 0, free_after = 0, total = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_before, &total));
  const uint64_t kv_bytes = cuda::KvBytes(config), ws_bytes = cuda::WorkspaceBytes(config);
  const uint64_t out_bytes = in_place ? 0 : static_cast<uint64_t>(n) * hd * 2;
  uint8_t *kv = nullptr, *ws = nullptr;
  uint16_t* out = x;
  CHECK_CUDA(cudaMalloc(&kv, kv_bytes));
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  if (!in_place) CHECK_CUDA(cudaMalloc(&out, out_bytes));
  CHECK_CUDA(cudaMemGetInfo(&free_after, &total));
  const uint64_t layer_bytes = kv_bytes + ws_bytes + out_bytes;

  LayerTensors t;
  t.x = x, t.w_qkv = w, t.out = out;

  // Warm-up (module load, cuBLASLt heuristics), then one instrumented run on fresh inputs.
  CHECK_OK(cuda::RunLayer(config, t, kv, ws, ctx, nullptr));
  refill();
  cuda::StageTimes st;
  ctx.times = &st;
  SparseReport sparse_report;
  CHECK_OK(cuda::RunLayer(config, t, kv, ws, ctx, nullptr, &sparse_report));
  ctx.times = nullptr;
  if (!rows_out.empty()) {
    std::vector<uint16_t> rows(64 * hd);
    for (int i = 0; i < 64; ++i) {
      const int64_t r = (i * n) / 64 + (i * 7) % std::max<int64_t>(1, n / 64);
      CHECK_CUDA(cudaMemcpy(rows.data() + i * hd, out + r * hd, hd * 2, cudaMemcpyDeviceToHost));
    }
    FILE* f = std::fopen(rows_out.c_str(), "wb");
    if (f) std::fwrite(rows.data(), 2, rows.size(), f), std::fclose(f);
  }
  char digests[96] = "";
  if (get("digest", "0") == "1") {
    std::snprintf(digests, sizeof(digests), ", \"kv_digest\": \"%016llx\", \"out_digest\": \"%016llx\"",
                  static_cast<unsigned long long>(DeviceDigest(kv, kv_bytes)),
                  static_cast<unsigned long long>(DeviceDigest(out, static_cast<uint64_t>(n) * hd * 2)));
  }

  // Timed runs (inputs refilled outside the timed region).
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    if (in_place) refill();
    CHECK_CUDA(cudaEventRecord(a, ctx.stream));
    CHECK_OK(cuda::RunLayer(config, t, kv, ws, ctx, nullptr));
    CHECK_CUDA(cudaEventRecord(b, ctx.stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms);
  }
  const float layer_ms = Median(times);
  CHECK_CUDA(cudaFree(kv));
  CHECK_CUDA(cudaFree(ws));
  if (!in_place) CHECK_CUDA(cudaFree(out));

  // Unchunked GEMMs, the projection's yardsticks: x · W_{k,v}ᵀ → [N, 2·H·d] (the K/V projection's)
  // and x · W_qkvᵀ → [N, 3·H·d] (the whole projection's), bf16, by the same cuBLASLt call the layer makes.
  float gemm_ms = 0, qkv_gemm_ms = 0;
  if (get("gemm", "1") == "1") {
    uint16_t* c = nullptr;
    void* blas_ws = nullptr;
    CHECK_CUDA(cudaMalloc(&c, static_cast<uint64_t>(n) * 3 * hd * 2));
    CHECK_CUDA(cudaMalloc(&blas_ws, cuda::kBlasWorkspaceBytes));
    cuda::BlasGemm gemm(ctx.blas, blas_ws);
    auto time_gemm = [&](const uint16_t* weights, int64_t cols) {
      cuda::GemmArgs g;
      g.a = x, g.lda = hidden, g.b = weights, g.ldb = hidden, g.c = c, g.ldc = cols;
      g.m = n, g.n = cols, g.k = hidden;
      CHECK_OK(gemm.Run(g, ctx.stream));  // warm-up
      std::vector<float> gt;
      for (int r = 0; r < 3; ++r) {
        CHECK_CUDA(cudaEventRecord(a, ctx.stream));
        CHECK_OK(gemm.Run(g, ctx.stream));
        CHECK_CUDA(cudaEventRecord(b, ctx.stream));
        CHECK_CUDA(cudaEventSynchronize(b));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
        gt.push_back(ms);
      }
      return Median(gt);
    };
    gemm_ms = time_gemm(w + hd * hidden, 2 * hd);
    qkv_gemm_ms = time_gemm(w, 3 * hd);
    CHECK_CUDA(cudaFree(c));
    CHECK_CUDA(cudaFree(blas_ws));
  }

  const double flops = 4.0 * static_cast<double>(n) * n * dim * heads;
  const double projection_ms = st.stats_ms + st.kv_gemm_ms + st.kv_epilogue_ms;
  const double projection_all_ms = projection_ms + st.q_gemm_ms + st.q_epilogue_ms;  // Q included
  std::printf(
      "{\"n\": %lld, \"hidden\": %d, \"heads\": %d, \"dim\": %d, \"format\": \"%s\", \"in_place\": %d, "
      "\"layer_ms\": %.3f, \"stats_ms\": %.3f, \"kv_gemm_ms\": %.3f, \"kv_epilogue_ms\": %.3f, \"q_gemm_ms\": %.3f, "
      "\"q_epilogue_ms\": %.3f, \"attention_ms\": %.3f, \"attention_tflops\": %.1f, \"projection_ms\": %.3f, "
      "\"unchunked_gemm_ms\": %.3f, \"projection_all_ms\": %.3f, \"qkv_gemm_ms\": %.3f, \"layer_gib\": %.4f, \"kv_gib\": %.4f, \"workspace_gib\": %.4f, "
      "\"measured_alloc_gib\": %.4f, \"tp\": %lld, \"tq\": %lld, \"tiling\": \"%s\", \"mma\": \"%s\", "
      "\"choose_per_head\": %d, \"sparse\": \"%s\", \"routed_fraction\": %.4f, \"routing_ms\": %.3f%s}\n",
      static_cast<long long>(n), hidden, heads, dim, fmt.c_str(), in_place ? 1 : 0, layer_ms, st.stats_ms,
      st.kv_gemm_ms, st.kv_epilogue_ms, st.q_gemm_ms, st.q_epilogue_ms, st.attention_ms,
      flops / (st.attention_ms * 1e-3) / 1e12, projection_ms, gemm_ms, projection_all_ms, qkv_gemm_ms,
      layer_bytes / 1073741824.0,
      kv_bytes / 1073741824.0, ws_bytes / 1073741824.0, (free_before - free_after) / 1073741824.0,
      static_cast<long long>(config.projection_chunk), static_cast<long long>(config.query_chunk), tiling.c_str(),
      MmaPathName(mma_path), config.transforms.choose_per_head ? 1 : 0,
      config.attention.sparse.enabled ? ("topk:" + topk + (config.attention.sparse.tail ? "" : ",no_tail")).c_str() : "off",
      config.attention.sparse.enabled ? sparse_report.RoutedFraction() : 1.0, st.routing_ms, digests);
  cudaFree(x);
  cudaFree(w);
  cublasLtDestroy(ctx.blas);
  return 0;
}
