// kvpack-eval: the accuracy of packed attention on the caller's Q/K/V (or structured synthetic
// data) against FP64 unquantized attention, as one JSON object.
//
//   kvpack-eval --q Q.npy --k K.npy --v V.npy [--format int4|int8|bf16] [--no-rotate] [--no-smooth]
//               [--no-balance] [--fixed-transforms] [--scale S] [--threads T]
//   kvpack-eval --synthetic N:H:d[:outlier_scale] [--data outliers|sinks|qknorm] [--queries M] [--seed S]
//               [same options]
//   kvpack-eval --locality F:Y:X:T:H:d [--data locality|qknorm|iid] [--seed S] [same options]
//   any of them with --sparse topk=R|tau=T [--no-tail] [--sink-pages K] [--min-exact-pages K]
//
// --locality: F frames × Y × X grid tokens after T text tokens, H heads of d channels
// (kernels/cpu/locality_data.h; --data qknorm its QK-normalised variant, iid the data without
// locality); every token is a query (self-attention). --sparse runs block-sparse attention
// (kernels/cpu/sparse_attention.h) and adds routed_fraction, exact/pooled pages and the dense packed
// path's errors (dense_rel_l2, dense_cosine) to the JSON; rel_l2 and cosine are the sparse path's
// error vs FP64 dense attention.
//
// --no-balance switches off both channel balancings (λ of K, λ_v of V); with all three --no-* flags
// the format is naive per-row quantization. --fixed-transforms turns off the per-head choice
// (kernels/transform_choice.h). The JSON has rel_l2, the mean cosine, the worst head and its
// cosine, the estimated rel_l2, and per head rel_l2, cosine, the kept transforms and the estimate.
// Arrays are float32 C-order .npy of shape [N, H, d]; Q may have another N. Every query sees every
// key (sequence id 0, not causal). Exit codes: 0 success, 2 bad arguments or input files (message on
// stderr), 1 an internal failure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/locality_data.h"
#include "kernels/cpu/quality.h"

namespace kvpack::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInternal = 1;
inline constexpr int kExitUsage = 2;

struct EvalOptions {
  std::string q_path, k_path, v_path;
  bool synthetic = false;
  cpu::SyntheticOptions synthetic_options;  // n_q defaults to min(N, kDefaultSyntheticQueries)
  bool locality = false;
  cpu::LocalityOptions locality_options;
  SparseOptions sparse;                     // enabled by --sparse
  PageFormat format = PageFormat::kInt4;
  MmaPath mma = MmaPath::kAuto;             // --mma auto|bf16|int8 (mma_path.h)
  TransformOptions transforms;
  float scale = 0.0f;  // 0: 1/sqrt(d)
  std::string dump_dir;  // --dump DIR: the inputs as DIR/{q,k,v}.npy (float32 [N, H, d]), for peers to run on
  int threads = 0;
};

inline constexpr int64_t kDefaultSyntheticQueries = 256;

// Parses argv. On failure returns false with *error set (exit kExitUsage).
bool ParseEvalArgs(const std::vector<std::string>& args, EvalOptions* options, std::string* error);

// Loads or generates the data, evaluates, and writes the JSON object to *json. Returns an exit code;
// on failure *error says why.
int RunEval(const EvalOptions& options, std::string* json, std::string* error);

extern const char kEvalUsage[];

}  // namespace kvpack::tools
