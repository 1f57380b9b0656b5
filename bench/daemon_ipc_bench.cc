// One layer through a running kvpackd (CUDA backend) with x and the output in CUDA IPC regions, the
// path a frontend on the same GPU takes: nothing is copied, the daemon reads x and writes the output
// where the caller's tensors are. Inputs are bench_layer's seeded ones (bench_inputs.h), so the
// figures compare with bench_layer's direct kernel calls on the same shape.
//
//   daemon_ipc_bench --server=127.0.0.1:50051 --n=152263 --hidden=7168 --heads=56 --dim=128
//                    --format=int4 [--in_place=1] [--reps=3]
//
// Prints one JSON line: median wall time of the AttentionLayer call (client side, inputs refilled
// before each in-place run outside the timing), the last call's wall time broken down by the daemon's
// stages (queue, plan, transfer, allocate, project, attend, their GPU-turn wait, release; the rest of
// the wall time is the RPC), the request's peak pool bytes
// and the planner's prediction, the plan's staging bytes, and the pool high-water from Status.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_inputs.h"
#include "client/client.h"

namespace {

using kvpack::v1::Format;

int Fail(const std::string& what) {
  std::fprintf(stderr, "daemon_ipc_bench: %s\n", what.c_str());
  return 1;
}

std::map<std::string, std::string> ParseFlags(int argc, char** argv) {
  std::map<std::string, std::string> flags = {{"server", "127.0.0.1:50051"}, {"n", "32768"}, {"hidden", "7168"},
                                              {"heads", "56"}, {"dim", "128"}, {"format", "int4"},
                                              {"in_place", "0"}, {"reps", "3"}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) flags[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  return flags;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> f = ParseFlags(argc, argv);
  const int64_t n = std::stoll(f["n"]);
  const int hidden = std::stoi(f["hidden"]), heads = std::stoi(f["heads"]), dim = std::stoi(f["dim"]);
  const bool in_place = f["in_place"] == "1";
  const int reps = std::stoi(f["reps"]);
  const Format format = f["format"] == "bf16" ? kvpack::v1::FORMAT_BF16
                        : f["format"] == "int8" ? kvpack::v1::FORMAT_INT8
                                                : kvpack::v1::FORMAT_INT4;
  const int64_t rows = 3ll * heads * dim;
  const uint64_t x_bytes = 2ull * n * hidden, w_bytes = 2ull * rows * hidden, out_bytes = 2ull * n * heads * dim;

  kvpack::client::ClientOptions co;
  co.address = f["server"];
  co.timeout = absl::Seconds(600);
  absl::StatusOr<std::unique_ptr<kvpack::client::Client>> client = kvpack::client::Client::Connect(co);
  if (!client.ok()) return Fail(std::string(client.status().message()));
  kvpack::client::Client& c = **client;

  // Inputs on the device, weights copied to the host for the inline upload.
  uint16_t* x = nullptr;
  uint16_t* w = nullptr;
  uint16_t* out = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&x), x_bytes) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&w), w_bytes) != cudaSuccess ||
      (!in_place && cudaMalloc(reinterpret_cast<void**>(&out), out_bytes) != cudaSuccess)) {
    return Fail("cudaMalloc failed");
  }
  const auto fill = [&] { return kvpack::bench::FillInputs(x, n, hidden, w, rows, 1ll * heads * dim, nullptr); };
  if (fill() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) return Fail("FillInputs failed");
  std::vector<uint16_t> w_host(w_bytes / 2);
  cudaMemcpy(w_host.data(), w, w_bytes, cudaMemcpyDeviceToHost);
  kvpack::client::WeightsData wd;
  wd.hidden = hidden;
  wd.n_heads = heads;
  wd.head_dim = dim;
  wd.w_qkv = w_host.data();
  absl::StatusOr<kvpack::v1::WeightsResponse> weights = c.RegisterWeights(wd);
  if (!weights.ok()) return Fail("RegisterWeights: " + std::string(weights.status().message()));

  const auto register_ipc = [&](void* ptr, uint64_t bytes) -> std::string {
    cudaIpcMemHandle_t handle;
    if (cudaIpcGetMemHandle(&handle, ptr) != cudaSuccess) return "";
    kvpack::v1::RegisterRegionRequest req;
    req.set_kind(kvpack::v1::REGION_CUDA_IPC);
    req.set_cuda_ipc_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
    req.set_size_bytes(bytes);
    kvpack::v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    const grpc::Status st = c.stub()->RegisterRegion(&ctx, req, &resp);
    if (!st.ok()) std::fprintf(stderr, "RegisterRegion: %s\n", st.error_message().c_str());
    return resp.region_id();
  };
  const std::string x_region = register_ipc(x, x_bytes);
  const std::string out_region = in_place ? "" : register_ipc(out, out_bytes);
  if (x_region.empty() || (!in_place && out_region.empty())) return Fail("CUDA IPC registration failed");

  kvpack::v1::LayerHeader h;
  h.mutable_shape()->set_n_tokens(n);
  h.mutable_shape()->set_hidden(hidden);
  h.mutable_shape()->set_n_heads(heads);
  h.mutable_shape()->set_head_dim(dim);
  kvpack::v1::TokenRange* range = h.add_ranges();
  range->set_begin(0);
  range->set_end(n);
  range->add_allowed_formats(format);
  h.set_weights_handle(weights->handle());
  kvpack::v1::RegionSlice* xs = h.mutable_x()->mutable_region();
  xs->set_region_id(x_region);
  xs->set_size_bytes(x_bytes);
  if (in_place) {
    h.mutable_output()->set_mode(kvpack::v1::OUTPUT_IN_PLACE);
  } else {
    h.mutable_output()->set_mode(kvpack::v1::OUTPUT_REGION);
    h.mutable_output()->mutable_region()->set_region_id(out_region);
    h.mutable_output()->mutable_region()->set_size_bytes(out_bytes);
  }

  std::vector<double> wall_ms;
  kvpack::v1::LayerResult last;
  double last_ms = 0;
  for (int i = 0; i < reps + 1; ++i) {  // the first call warms the daemon up (module load, handles)
    if (in_place && (fill() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)) return Fail("refill");
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<kvpack::v1::LayerResult> r = c.AttentionLayer(h, kvpack::client::LayerData{});
    const auto t1 = std::chrono::steady_clock::now();
    if (!r.ok()) return Fail("AttentionLayer: " + std::string(r.status().message()));
    last_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    if (i > 0) wall_ms.push_back(last_ms);
    last = *r;
  }
  std::sort(wall_ms.begin(), wall_ms.end());
  absl::StatusOr<kvpack::v1::StatusResponse> status = c.Status();
  // Where the wall time of the last call went: the daemon's stages, and the RPC around them
  // (wall − total: gRPC, the reactor, the client).
  const kvpack::v1::StageSeconds& sec = last.seconds();
  std::printf(
      "{\"impl\": \"kvpackd cuda ipc\", \"n\": %lld, \"heads\": %d, \"dim\": %d, \"format\": \"%s\", \"in_place\": %d, "
      "\"layer_ms\": %.1f, \"last_ms\": %.1f, \"queue_ms\": %.2f, \"plan_ms\": %.2f, \"transfer_ms\": %.2f, "
      "\"allocate_ms\": %.2f, \"project_ms\": %.2f, \"attend_ms\": %.2f, \"turn_wait_ms\": %.2f, \"release_ms\": %.2f, "
      "\"daemon_total_ms\": %.2f, \"rpc_ms\": %.2f, \"peak_bytes\": %llu, "
      "\"predicted_peak_bytes\": %llu, \"io_bytes\": %llu, \"weights_bytes\": %llu, \"pool_high_water\": %llu}\n",
      static_cast<long long>(n), heads, dim, f["format"].c_str(), in_place ? 1 : 0, wall_ms[wall_ms.size() / 2],
      last_ms, 1e3 * sec.queue(), 1e3 * sec.plan(), 1e3 * sec.transfer(), 1e3 * sec.allocate(), 1e3 * sec.project(),
      1e3 * sec.attend(), 1e3 * sec.turn_wait(), 1e3 * sec.release(), 1e3 * sec.total(), last_ms - 1e3 * sec.total(),
      static_cast<unsigned long long>(last.peak_bytes()),
      static_cast<unsigned long long>(last.plan().predicted_peak_bytes()),
      static_cast<unsigned long long>(last.plan().io_bytes()),
      static_cast<unsigned long long>(weights->pool_bytes()),
      static_cast<unsigned long long>(status.ok() ? status->high_water_bytes() : 0));
  absl::Status cleanup = c.UnregisterRegion(x_region);
  if (cleanup.ok() && !in_place) cleanup = c.UnregisterRegion(out_region);
  if (cleanup.ok()) cleanup = c.ReleaseWeights(weights->handle());
  if (!cleanup.ok()) return Fail("cleanup: " + std::string(cleanup.message()));
  return 0;
}
