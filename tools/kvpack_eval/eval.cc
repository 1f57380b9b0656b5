#include "tools/kvpack_eval/eval.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "kernels/cpu/layer.h"
#include "kernels/layer_spec.h"
#include "kernels/transform_choice.h"
#include "tools/kvpack_eval/npy.h"

namespace kvpack::tools {
namespace {

const char* FormatName(PageFormat f) {
  return f == PageFormat::kInt4 ? "int4" : f == PageFormat::kInt8 ? "int8" : "bf16";
}

bool ParseInt(const std::string& s, int64_t* v) {
  if (s.empty()) return false;
  char* end = nullptr;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (*end != '\0') return false;
  *v = x;
  return true;
}

bool ParseDouble(const std::string& s, double* v) {
  if (s.empty()) return false;
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return *end == '\0' && std::isfinite(*v);
}

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

// Checks an [N, H, d] array; sets n, heads, d.
bool CheckShape(const NpyArray& a, const std::string& name, int64_t* n, int64_t* heads, int64_t* d, std::string* error) {
  if (a.shape.size() != 3) {
    *error = name + ": shape has " + std::to_string(a.shape.size()) + " dimensions, expected 3 ([N, H, d])";
    return false;
  }
  *n = a.shape[0], *heads = a.shape[1], *d = a.shape[2];
  if (*n <= 0 || *heads <= 0 || *d <= 0) {
    *error = name + ": every dimension of [N, H, d] must be positive";
    return false;
  }
  return true;
}

bool AllFinite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// "k:smooth+balance v:half-smooth+balance (chosen)" and the like.
std::string HeadFlagsText(uint32_t f) {
  std::string k = (f & kHeadSmoothK) ? "smooth" : "none";
  if (f & kHeadBalanceK) k += "+balance";
  std::string v = (f & kHeadSmoothV) ? "smooth" : (f & kHeadSmoothVHalf) ? "half-smooth" : "none";
  if (f & kHeadBalanceV) v += "+balance";
  return "k:" + k + " v:" + v + ((f & kHeadChosen) ? " (chosen)" : "");
}

}  // namespace

const char kEvalUsage[] =
    "usage: kvpack-eval (--q Q.npy --k K.npy --v V.npy | --synthetic N:H:d[:outlier_scale] [--queries M] [--seed S])\n"
    "                   [--data outliers|sinks|qknorm] [--format int4|int8|bf16] [--no-rotate] [--no-smooth]\n"
    "                   [--no-balance] [--fixed-transforms] [--scale S] [--threads T]\n"
    "Prints one JSON object: rel_l2 and cosine of packed attention vs FP64 unquantized attention, per head\n"
    "and overall (mean cosine, worst head), the per-head transform choice and the estimated rel_l2.\n"
    "--no-rotate, --no-smooth, --no-balance switch off the format's transforms (balance: K and V channel\n"
    "balancing, lambda and lambda_v); all three off is naive per-row quantization. --fixed-transforms\n"
    "gives every head all allowed transforms instead of the per-head choice. --data picks the synthetic kind.\n"
    "       kvpack-eval --locality F:Y:X:T:H:d [--data locality|qknorm|iid] [--seed S] [same options]\n"
    "Any of them with --sparse topk=R|tau=T [--no-tail] [--sink-pages K] [--min-exact-pages K]: block-sparse\n"
    "attention; the JSON adds routed_fraction and the dense packed path's dense_rel_l2 and dense_cosine.\n"
    "--mma auto|bf16|int8|fp8: the tensor-core arithmetic (kernels/mma_path.h; auto as the daemon resolves it;\n"
    "fp8 is the CPU's emulation of a path no GPU kernel runs yet);\n"
    "the JSON names the path run (mma) and its own error, mma_rel_l2: its output vs the exact (fp32) attention\n"
    "over the same pages (0 on the bf16 path).\n"
    "--dump DIR also writes the inputs (files, synthetic or locality data) as DIR/q.npy, k.npy, v.npy\n"
    "(float32 [N, H, d]; the directory must exist), so that another attention can run on the same data.\n";

bool ParseEvalArgs(const std::vector<std::string>& args, EvalOptions* o, std::string* error) {
  int64_t queries = -1;
  bool data_given = false;
  std::string data_kind, sparse_flag;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= args.size()) {
        *error = a + " needs a value";
        return false;
      }
      *out = args[++i];
      return true;
    };
    std::string v;
    if (a == "--q" || a == "--k" || a == "--v") {
      if (!value(&v)) return false;
      (a == "--q" ? o->q_path : a == "--k" ? o->k_path : o->v_path) = v;
    } else if (a == "--format") {
      if (!value(&v)) return false;
      if (v == "int4") o->format = PageFormat::kInt4;
      else if (v == "int8") o->format = PageFormat::kInt8;
      else if (v == "bf16") o->format = PageFormat::kBf16;
      else return *error = "--format " + v + ": expected int4, int8 or bf16", false;
    } else if (a == "--mma") {
      if (!value(&v)) return false;
      if (v == "auto") o->mma = MmaPath::kAuto;
      else if (v == "bf16") o->mma = MmaPath::kBf16;
      else if (v == "int8") o->mma = MmaPath::kInt8;
      else if (v == "fp8") o->mma = MmaPath::kFp8;
      else return *error = "--mma " + v + ": expected auto, bf16, int8 or fp8", false;
    } else if (a == "--no-rotate") {
      o->transforms.rotate = false;
    } else if (a == "--no-smooth") {
      o->transforms.smooth = false;
    } else if (a == "--no-balance") {
      o->transforms.balance = false;
    } else if (a == "--fixed-transforms") {
      o->transforms.choose_per_head = false;
    } else if (a == "--data") {
      if (!value(&v)) return false;
      data_kind = v;
      data_given = true;
    } else if (a == "--sparse") {
      if (!value(&v)) return false;
      double x;
      o->sparse.enabled = true;
      if (v.rfind("topk=", 0) == 0 && ParseDouble(v.substr(5), &x)) {
        o->sparse.mode = SparseMode::kTopK;
        o->sparse.topk_ratio = static_cast<float>(x);
      } else if (v.rfind("tau=", 0) == 0 && ParseDouble(v.substr(4), &x)) {
        o->sparse.mode = SparseMode::kRelTau;
        o->sparse.rel_tau = static_cast<float>(x);
      } else {
        return *error = "--sparse " + v + ": expected topk=R or tau=T", false;
      }
      if (Error e = ValidateSparse(o->sparse); !e.ok()) return *error = "--sparse " + v + ": " + e.message(), false;
    } else if (a == "--dump") {
      if (!value(&o->dump_dir)) return false;
      if (o->dump_dir.empty()) return *error = "--dump needs a directory", false;
    } else if (a == "--no-tail") {
      o->sparse.tail = false;
      sparse_flag = a;
    } else if (a == "--sink-pages" || a == "--min-exact-pages") {
      int64_t x;
      if (!value(&v)) return false;
      if (!ParseInt(v, &x) || x < 0 || x > kMaxSinkPages) return *error = a + " " + v + ": expected 0..1024", false;
      (a == "--sink-pages" ? o->sparse.sink_pages : o->sparse.min_exact_pages) = static_cast<int>(x);
      sparse_flag = a;
    } else if (a == "--locality") {
      if (!value(&v)) return false;
      std::vector<std::string> parts;
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
      int64_t x[6];
      bool ok = parts.size() == 6;
      for (size_t p = 0; ok && p < 6; ++p) ok = ParseInt(parts[p], &x[p]) && x[p] >= (p == 3 ? 0 : 1) && x[p] <= (1 << 20);
      if (!ok || x[0] * x[1] * x[2] + x[3] > (int64_t{1} << 24)) {
        return *error = "--locality " + v + ": expected F:Y:X:T:H:d (T >= 0, the rest positive, at most 2^24 tokens)",
               false;
      }
      o->locality = true;
      cpu::LocalityOptions& l = o->locality_options;
      l.frames = static_cast<int>(x[0]), l.height = static_cast<int>(x[1]), l.width = static_cast<int>(x[2]);
      l.text_tokens = x[3], l.n_heads = static_cast<int>(std::min<int64_t>(x[4], 4096));
      l.head_dim = static_cast<int>(x[5]);
    } else if (a == "--scale") {
      double s;
      if (!value(&v)) return false;
      if (!ParseDouble(v, &s) || s <= 0.0) return *error = "--scale " + v + ": expected a positive number", false;
      o->scale = static_cast<float>(s);
    } else if (a == "--threads") {
      int64_t t;
      if (!value(&v)) return false;
      if (!ParseInt(v, &t) || t < 0 || t > 1024) return *error = "--threads " + v + ": expected 0..1024", false;
      o->threads = static_cast<int>(t);
    } else if (a == "--queries") {
      if (!value(&v)) return false;
      if (!ParseInt(v, &queries) || queries <= 0) return *error = "--queries " + v + ": expected a positive count", false;
    } else if (a == "--seed") {
      int64_t s;
      if (!value(&v)) return false;
      if (!ParseInt(v, &s)) return *error = "--seed " + v + ": expected an integer", false;
      o->synthetic_options.seed = static_cast<uint64_t>(s);
      o->locality_options.seed = static_cast<uint64_t>(s);
    } else if (a == "--synthetic") {
      if (!value(&v)) return false;
      std::vector<std::string> parts;
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
      int64_t n, h, d;
      double outliers = 20.0;
      if ((parts.size() != 3 && parts.size() != 4) || !ParseInt(parts[0], &n) || !ParseInt(parts[1], &h) ||
          !ParseInt(parts[2], &d) || (parts.size() == 4 && !ParseDouble(parts[3], &outliers)) || n <= 0 || h <= 0 ||
          h > 4096 || d <= 0 || outliers <= 0.0) {
        *error = "--synthetic " + v + ": expected N:H:d[:outlier_scale] with positive values";
        return false;
      }
      o->synthetic = true;
      o->synthetic_options.n_k = n;
      o->synthetic_options.n_heads = static_cast<int>(h);
      o->synthetic_options.head_dim = static_cast<int>(d);
      o->synthetic_options.outlier_scale = outliers;
    } else if (a == "--help" || a == "-h") {
      *error = "";
      return false;
    } else {
      *error = "unknown argument '" + a + "'";
      return false;
    }
  }
  if (!sparse_flag.empty() && !o->sparse.enabled) return *error = sparse_flag + " only applies with --sparse", false;
  if (o->locality) {
    if (o->synthetic || !o->q_path.empty() || !o->k_path.empty() || !o->v_path.empty() || queries > 0) {
      *error = "--locality excludes --synthetic, --q/--k/--v and --queries";
      return false;
    }
    if (data_given && data_kind != "locality" && data_kind != "qknorm" && data_kind != "iid") {
      return *error = "--data " + data_kind + ": expected locality, qknorm or iid with --locality", false;
    }
    o->locality_options.qk_norm = data_kind == "qknorm";
    o->locality_options.iid = data_kind == "iid";
    o->locality_options.softmax_scale = o->scale;
    return true;
  }
  if (data_given && !cpu::ParseSyntheticKind(data_kind, &o->synthetic_options.kind)) {
    return *error = "--data " + data_kind + ": expected outliers, sinks or qknorm", false;
  }
  if (o->synthetic) {
    if (!o->q_path.empty() || !o->k_path.empty() || !o->v_path.empty()) {
      *error = "--synthetic and --q/--k/--v exclude each other";
      return false;
    }
    o->synthetic_options.n_q = queries > 0 ? queries : std::min(o->synthetic_options.n_k, kDefaultSyntheticQueries);
  } else if (o->q_path.empty() || o->k_path.empty() || o->v_path.empty()) {
    *error = "give --q, --k and --v (or --synthetic N:H:d)";
    return false;
  } else if (queries > 0 || data_given) {
    *error = std::string(queries > 0 ? "--queries" : "--data") + " only applies to --synthetic";
    return false;
  }
  o->synthetic_options.softmax_scale = o->scale;
  return true;
}

int RunEval(const EvalOptions& o, std::string* json, std::string* error) {
  // Inputs: files or synthetic data, all [N, H, d].
  NpyArray q, k, v;
  int64_t n_q, n_k, heads, d;
  if (o.locality) {
    const int64_t sd = o.locality_options.head_dim;
    if (sd < kMinHeadDimCpu || sd > kMaxHeadDimCpu || (sd & (sd - 1)) != 0) {
      *error = "--locality: head_dim " + std::to_string(sd) + " is not supported (a power of two from 16 to 256)";
      return kExitUsage;
    }
    cpu::SyntheticData data = cpu::MakeLocalityData(o.locality_options);
    n_q = n_k = o.locality_options.Tokens();
    heads = o.locality_options.n_heads, d = sd;
    q.data = std::move(data.q), k.data = std::move(data.k), v.data = std::move(data.v);
  } else if (o.synthetic) {
    const int64_t sd = o.synthetic_options.head_dim;
    if (sd < kMinHeadDimCpu || sd > kMaxHeadDimCpu || (sd & (sd - 1)) != 0) {
      *error = "--synthetic: head_dim " + std::to_string(sd) + " is not supported (a power of two from 16 to 256)";
      return kExitUsage;
    }
    cpu::SyntheticData data = cpu::MakeSyntheticData(o.synthetic_options);
    n_q = o.synthetic_options.n_q, n_k = o.synthetic_options.n_k;
    heads = o.synthetic_options.n_heads, d = sd;
    q.data = std::move(data.q), k.data = std::move(data.k), v.data = std::move(data.v);
  } else {
    if (!ReadNpy(o.q_path, &q, error) || !ReadNpy(o.k_path, &k, error) || !ReadNpy(o.v_path, &v, error)) return kExitUsage;
    int64_t vn, vh, vd, qh, qd;
    if (!CheckShape(q, o.q_path, &n_q, &qh, &qd, error) || !CheckShape(k, o.k_path, &n_k, &heads, &d, error) ||
        !CheckShape(v, o.v_path, &vn, &vh, &vd, error)) {
      return kExitUsage;
    }
    if (vn != n_k || vh != heads || vd != d) {
      *error = "K and V shapes differ: K is [" + std::to_string(n_k) + ", " + std::to_string(heads) + ", " +
               std::to_string(d) + "], V is [" + std::to_string(vn) + ", " + std::to_string(vh) + ", " +
               std::to_string(vd) + "]";
      return kExitUsage;
    }
    if (qh != heads || qd != d) {
      *error = "Q has H = " + std::to_string(qh) + ", d = " + std::to_string(qd) + " but K has H = " +
               std::to_string(heads) + ", d = " + std::to_string(d);
      return kExitUsage;
    }
    if (!AllFinite(q.data) || !AllFinite(k.data) || !AllFinite(v.data)) {
      *error = "inputs hold NaN or infinite values";
      return kExitUsage;
    }
  }
  LayerShape shape{n_k, static_cast<int>(heads * d), static_cast<int>(heads), static_cast<int>(d)};
  if (heads > INT32_MAX / d) return *error = "H·d is too large", kExitUsage;
  if (Error e = ValidateShape(shape, false); !e.ok()) return *error = e.message(), kExitUsage;

  if (!o.dump_dir.empty()) {
    const std::pair<const char*, const NpyArray*> arrays[] = {{"q", &q}, {"k", &k}, {"v", &v}};
    for (const auto& [name, array] : arrays) {
      const std::string path = o.dump_dir + "/" + name + ".npy";
      const int64_t rows = array == &q ? n_q : n_k;
      if (!WriteNpy(path, {rows, heads, d}, array->data)) return *error = "--dump: cannot write " + path, kExitUsage;
    }
  }

  // Reference and packed attention.
  AttentionOptions attention;
  attention.softmax_scale = o.scale;
  attention.mma = o.mma;
  const MmaPath mma = ResolveMmaPath(o.mma, o.format == PageFormat::kBf16, shape.head_dim, o.transforms.rotate);
  cpu::QueryBlock queries;
  queries.q = q.data.data();
  queries.n_q = n_q;
  std::vector<double> ref(q.data.size());
  cpu::ReferenceAttention(queries, k.data.data(), v.data.data(), nullptr, n_k, shape.n_heads, shape.head_dim, attention,
                          ref.data());
  std::vector<float> out(q.data.size());
  // The MMA path's own error: its output against the exact (fp32, bf16-MMA) path over the same pages
  // (the same entry: the per-head choice may differ between the paths when each packs its own).
  std::vector<float> exact(mma != MmaPath::kBf16 ? q.data.size() : 0);
  double bits = 0.0;
  cpu::TransformRecord record;
  const Error e = cpu::AttendPackedFloat(q.data.data(), n_q, k.data.data(), v.data.data(), n_k, shape.n_heads,
                                         shape.head_dim, o.format, o.transforms, attention, cpu::CpuOptions{o.threads},
                                         out.data(), &bits, &record, nullptr, exact.empty() ? nullptr : exact.data());
  if (!e.ok()) return *error = e.message(), kExitInternal;
  const cpu::QualityResult dense = cpu::CompareOutputs(ref.data(), out.data(), n_q, shape.n_heads, shape.head_dim);
  double mma_rel_l2 = 0.0;
  if (!exact.empty()) {
    const std::vector<double> exact_d(exact.begin(), exact.end());
    mma_rel_l2 = cpu::CompareOutputs(exact_d.data(), out.data(), n_q, shape.n_heads, shape.head_dim).rel_l2;
  }
  cpu::QualityResult r = dense;
  SparseReport report;
  if (o.sparse.enabled) {
    AttentionOptions sparse_attention = attention;
    sparse_attention.sparse = o.sparse;
    const Error se = cpu::AttendPackedFloat(q.data.data(), n_q, k.data.data(), v.data.data(), n_k, shape.n_heads,
                                            shape.head_dim, o.format, o.transforms, sparse_attention,
                                            cpu::CpuOptions{o.threads}, out.data(), nullptr, nullptr, &report);
    if (!se.ok()) return *error = se.message(), kExitInternal;
    r = cpu::CompareOutputs(ref.data(), out.data(), n_q, shape.n_heads, shape.head_dim);
  }

  // One JSON object.
  std::ostringstream j;
  j << "{\"format\": \"" << FormatName(o.format) << "\", \"rotate\": " << (o.transforms.rotate ? "true" : "false")
    << ", \"smooth\": " << (o.transforms.smooth ? "true" : "false")
    << ", \"balance\": " << (o.transforms.balance ? "true" : "false")
    << ", \"choose_per_head\": " << (o.transforms.choose_per_head ? "true" : "false")
    << ", \"scale\": " << Number(o.scale > 0.0f ? o.scale : 1.0 / std::sqrt(static_cast<double>(d)))
    << ", \"n_q\": " << n_q << ", \"n_k\": " << n_k << ", \"n_heads\": " << heads << ", \"head_dim\": " << d;
  if (o.locality) {
    const cpu::LocalityOptions& l = o.locality_options;
    j << ", \"locality\": {\"frames\": " << l.frames << ", \"height\": " << l.height << ", \"width\": " << l.width
      << ", \"text_tokens\": " << l.text_tokens << ", \"data\": \""
      << (l.iid ? "iid" : l.qk_norm ? "qknorm" : "locality") << "\", \"seed\": " << l.seed << "}";
  }
  if (o.sparse.enabled) {
    j << ", \"sparse\": {\"" << (o.sparse.mode == SparseMode::kTopK ? "topk_ratio" : "rel_tau") << "\": "
      << Number(o.sparse.mode == SparseMode::kTopK ? o.sparse.topk_ratio : o.sparse.rel_tau)
      << ", \"tail\": " << (o.sparse.tail ? "true" : "false") << ", \"sink_pages\": " << o.sparse.sink_pages
      << ", \"min_exact_pages\": " << o.sparse.min_exact_pages << "}, \"routed_fraction\": "
      << Number(report.RoutedFraction()) << ", \"exact_pages\": " << report.exact_pages
      << ", \"pooled_pages\": " << report.pooled_pages << ", \"visible_pages\": " << report.visible_pages
      << ", \"dense_rel_l2\": " << Number(dense.rel_l2) << ", \"dense_cosine\": " << Number(dense.cosine);
  }
  if (o.synthetic) {
    j << ", \"synthetic\": {\"data\": \"" << cpu::SyntheticKindName(o.synthetic_options.kind)
      << "\", \"outlier_scale\": " << Number(o.synthetic_options.outlier_scale)
      << ", \"seed\": " << o.synthetic_options.seed << "}";
  }
  j << ", \"mma\": \"" << MmaPathName(mma) << "\", \"mma_rel_l2\": " << Number(mma_rel_l2);
  j << ", \"bits_per_value\": " << Number(bits) << ", \"rel_l2\": " << Number(r.rel_l2)
    << ", \"cosine\": " << Number(r.cosine) << ", \"worst_head\": " << r.worst_head
    << ", \"worst_head_cosine\": " << Number(r.worst_head_cosine)
    << ", \"estimated_rel_l2\": " << Number(EstimatedRelError(record.head_estimates.data(), shape.n_heads, o.format))
    << ", \"heads\": [";
  for (int h = 0; h < shape.n_heads; ++h) {
    const float* est = record.head_estimates.data() + static_cast<int64_t>(h) * kHeadEstimateFields;
    j << (h ? ", " : "") << "{\"rel_l2\": " << Number(r.head_rel_l2[h]) << ", \"cosine\": " << Number(r.head_cosine[h])
      << ", \"transforms\": \"" << HeadFlagsText(record.head_flags[h]) << "\", \"estimated_rel_l2\": "
      << Number(EstimatedRelError(est, 1, o.format)) << "}";
  }
  j << "]}";
  *json = j.str();
  return kExitOk;
}

}  // namespace kvpack::tools
