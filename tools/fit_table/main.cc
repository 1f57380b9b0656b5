// fit_table: the longest single-layer sequence (H3's geometry by default) that fits on cards of
// given sizes, for PyTorch (x·Wᵀ + SDPA cuDNN, a byte model) and for kvpack (the planner with the
// CUDA backend's byte functions: cuda::KvBytes, cuda::WorkspaceBytes, HostStagingBytes — what
// kvpackd --backend=cuda plans with). See fit_table.h for both models.
//
//   fit_table [--cards=12,16,24,80,141] [--hidden=5376] [--context_mib=512] [--cudnn_workspace_mib=64]
//   fit_table --n=N --card=GIB     the device bytes of every column at N tokens (a spot check)
//
// Prints a Markdown table of token counts, then the bytes at each entry and what stops one token
// more. Exit 2 on a bad flag.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/layer.h"
#include "server/backends/backend.h"
#include "server/core/error_status.h"
#include "tools/fit_table/fit_table.h"

namespace kvpack::tools {
namespace {

constexpr int64_t kMaxTokens = INT32_MAX;  // ValidateShape's limit

server::PlannerCosts CudaCosts() {
  server::PlannerCosts costs;
  costs.supported = [](const LayerConfig& c) { return server::ToStatus(cuda::Supported(c)); };
  costs.kv_bytes = [](const LayerConfig& c) { return cuda::KvBytes(c); };
  costs.workspace_bytes = [](const LayerConfig& c) { return cuda::WorkspaceBytes(c); };
  costs.io_bytes = [](const LayerConfig& c, const server::TensorResidency& r) {
    return server::HostStagingBytes(c, r);
  };
  return costs;
}

std::vector<KvpackMode> Modes(const FitGeometry& g) {
  const std::vector<PageFormat> int4 = {PageFormat::kInt4}, int8 = {PageFormat::kInt8}, bf16 = {PageFormat::kBf16};
  std::vector<KvpackMode> modes = {{"kvpack INT4", int4, int4, int4, false},
                                   {"kvpack INT8", int8, int8, int8, false},
                                   {"kvpack mixed", bf16, int8, int4, false}};
  if (g.HeadCols() == static_cast<uint64_t>(g.hidden)) modes.push_back({"kvpack INT4 in place", int4, int4, int4, true});
  return modes;
}

bool ParseFlag(const std::string& arg, const char* name, std::string* value) {
  const std::string prefix = std::string("--") + name + "=";
  if (arg.rfind(prefix, 0) != 0) return false;
  *value = arg.substr(prefix.size());
  return true;
}

std::string Tokens(int64_t n) {  // 152263 -> "152,263"
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

int Run(int argc, char** argv) {
  FitOptions o;
  std::vector<double> cards = {12, 16, 24, 80, 141};
  int64_t spot_n = 0;
  double spot_card = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string v;
    if (ParseFlag(arg, "cards", &v)) {
      cards.clear();
      for (size_t p = 0; p <= v.size();) {
        const size_t comma = v.find(',', p);
        cards.push_back(std::atof(v.substr(p, comma - p).c_str()));
        if (comma == std::string::npos) break;
        p = comma + 1;
      }
    } else if (ParseFlag(arg, "hidden", &v)) {
      o.geometry.hidden = std::atoi(v.c_str());
    } else if (ParseFlag(arg, "context_mib", &v)) {
      o.context_bytes = static_cast<uint64_t>(std::atof(v.c_str()) * kMiB);
    } else if (ParseFlag(arg, "cudnn_workspace_mib", &v)) {
      o.cudnn_workspace_bytes = static_cast<uint64_t>(std::atof(v.c_str()) * kMiB);
    } else if (ParseFlag(arg, "n", &v)) {
      spot_n = std::atoll(v.c_str());
    } else if (ParseFlag(arg, "card", &v)) {
      spot_card = std::atof(v.c_str());
    } else {
      std::fprintf(stderr, "fit_table: unknown flag %s (see the top of tools/fit_table/main.cc)\n", arg.c_str());
      return 2;
    }
  }
  for (double c : cards) {
    if (!(c > 0)) {
      std::fprintf(stderr, "fit_table: --cards: sizes in GiB must be positive\n");
      return 2;
    }
  }
  if (o.geometry.hidden <= 0 || o.geometry.hidden % 8 != 0) {
    std::fprintf(stderr, "fit_table: --hidden must be a positive multiple of 8\n");
    return 2;
  }
  const server::PlannerCosts costs = CudaCosts();
  const std::vector<KvpackMode> modes = Modes(o.geometry);
  std::printf("Geometry: x [N, %d] bf16, W_qkv [%llu, %d], %d heads x %d, RMSNorm q/k, split-half RoPE on 96 dims; "
              "CUDA context %.0f MiB per process; other tensors 0.\n\n",
              o.geometry.hidden, static_cast<unsigned long long>(3 * o.geometry.HeadCols()), o.geometry.hidden,
              o.geometry.n_heads, o.geometry.head_dim, static_cast<double>(o.context_bytes) / kMiB);

  if (spot_n > 0) {
    const uint64_t card = static_cast<uint64_t>(spot_card * kGiB);
    const Breakdown t = TorchBytes(spot_n, o);
    std::printf("N = %s on %.2f GiB\n  PyTorch cuDNN: %s (%s)\n", Tokens(spot_n).c_str(), spot_card,
                t.ToString().c_str(), t.Total() <= card ? "fits" : "does not fit");
    for (const KvpackMode& m : modes) {
      const KvpackFit f = KvpackBytes(spot_n, card, m, o, costs);
      std::printf("  %s: %s (%s; Tp = Tq = %lld)%s%s\n", m.name.c_str(), f.bytes.ToString().c_str(),
                  f.fits ? "fits" : "does not fit", static_cast<long long>(f.plan.projection_chunk),
                  f.fits ? "" : ": ", f.fits ? "" : f.reason.c_str());
    }
    return 0;
  }

  std::string header = "| card (GiB) | PyTorch cuDNN |", rule = "|---:|---:|";
  for (const KvpackMode& m : modes) header += " " + m.name + " |", rule += "---:|";
  std::printf("%s\n%s\n", header.c_str(), rule.c_str());
  std::vector<std::string> bounds;
  for (double gib : cards) {
    const uint64_t card = static_cast<uint64_t>(gib * kGiB);
    char label[32];
    std::snprintf(label, sizeof(label), "%g", gib);
    std::string row = std::string("| ") + label + " |";
    const int64_t torch_n = LongestFit([&](int64_t n) { return TorchBytes(n, o).Total() <= card; }, kMaxTokens);
    row += " " + Tokens(torch_n) + " |";
    bounds.push_back(std::string("- ") + label + " GiB, PyTorch cuDNN, N = " + Tokens(torch_n) + ": " +
                     TorchBytes(torch_n, o).ToString());
    for (const KvpackMode& m : modes) {
      const int64_t n = LongestFit([&](int64_t k) { return KvpackBytes(k, card, m, o, costs).fits; }, kMaxTokens);
      row += " " + Tokens(n) + " |";
      const KvpackFit at = KvpackBytes(n, card, m, o, costs);
      const KvpackFit next = KvpackBytes(n + 1, card, m, o, costs);
      char chunk[48];
      std::snprintf(chunk, sizeof(chunk), " (Tp = Tq = %lld)", static_cast<long long>(at.plan.projection_chunk));
      bounds.push_back(std::string("- ") + label + " GiB, " + m.name + ", N = " + Tokens(n) + ": " +
                       at.bytes.ToString() + chunk + "; one token more: " + next.reason);
    }
    std::printf("%s\n", row.c_str());
  }
  std::printf("\nBytes at each entry (GiB):\n");
  for (const std::string& b : bounds) std::printf("%s\n", b.c_str());
  return 0;
}

}  // namespace
}  // namespace kvpack::tools

int main(int argc, char** argv) { return kvpack::tools::Run(argc, argv); }
