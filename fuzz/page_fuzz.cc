// Fuzz target: the packed K/V format on arbitrary bytes (kernels/format.h, kernels/layer_spec.h,
// the CPU attention that reads pages).
//
// Input, read front to back by a Reader (missing bytes read as zero):
//   1. raw ValidateShape / ValidateRanges on unbounded values (any int64 begin/end, any format
//      byte): must answer without UB, and ranges it accepts must tile [0, N);
//   2. a small valid entry (d a power of two 16..256, H ≤ 2, ≤ 4 ranges of ≤ 80 tokens, any formats
//      and sequence ids) laid out by PlanKvLayout: every page must sit inside the block and before
//      the tables, and pages must match BuildPageLayout; the pages and statistics are then filled
//      with the remaining input bytes (arbitrary codes, fp16 metadata, NaN/Inf included), every
//      valid row of every page is decoded, and a tile of queries attends over each head;
//   3. one row encoded by each format from input floats (finite, |x| ≤ 30000) and decoded: the
//      error stays within one quantization step (named tolerances below).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/format.h"
#include "kernels/layer_spec.h"

namespace kvpack {
namespace {

// Round-trip tolerances. INT8: half a step of the scale as stored (the encoder's scale is never
// below max|x| / 127, so no code clips: format.h RowScaleToHalf), with room for the fp32 product
// x · (1/scale) (relative 2^-24 of codes ≤ 127). INT4: one step plus fp16 metadata's 11 significant
// bits (relative 2^-11 on lo and scale, at most ~1e-3 of max|x| after 15 steps) plus lo's rounding
// to a subnormal fp16 (half of 2^-24). BF16 keeps 8 bits (relative 2^-8 per value).
constexpr float kInt8HalfStep = 0.5f + 1e-4f;
constexpr float kMetaRelTolerance = 2e-3f;
constexpr float kLoSubnormalRounding = 0x1p-25f;
constexpr float kBf16RelTolerance = 1.0f / 256;
// Below float's normal range bf16 keeps fewer significant bits: its subnormals are 2^-133 apart, so
// rounding errs by up to half of that whatever the value (found by page_fuzz: 3.2e-43 → 0).
constexpr float kBf16SubnormalHalfStep = 0x1p-134f;
constexpr float kMaxInput = 30000.0f;  // below fp16's 65504 with room for max − min

// The entry's bounds (EntryOverArbitraryBytes).
constexpr int kMaxHeads = 2;
constexpr int kMaxRangeTokens = kPageTokens + kPageTokens / 4;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "page_fuzz: %s\n", what.c_str());
  std::abort();
}

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t U8() { return pos_ < size_ ? data_[pos_++] : 0; }
  template <typename T>
  T Raw() {
    uint8_t bytes[sizeof(T)] = {};
    for (size_t i = 0; i < sizeof(T); ++i) bytes[i] = U8();
    T v;
    std::memcpy(&v, bytes, sizeof(T));
    return v;
  }
  // Fills `n` bytes from the rest of the input, repeated (zeros if there is none). Whole copies of
  // the rest, not a byte loop with a division each: an entry's block is up to ~0.3 MB per exec.
  void Fill(uint8_t* out, size_t n) {
    const size_t left = size_ - pos_;
    if (left == 0) {
      std::memset(out, 0, n);
      return;
    }
    for (size_t i = 0; i < n; i += left) std::memcpy(out + i, data_ + pos_, std::min(left, n - i));
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

void RawValidation(Reader& in) {
  LayerShape shape;
  shape.n_tokens = in.Raw<int64_t>();
  shape.hidden = in.Raw<int32_t>();
  shape.n_heads = in.Raw<int32_t>();
  shape.head_dim = in.Raw<int32_t>();
  (void)ValidateShape(shape, /*for_gpu=*/in.U8() & 1);
  std::vector<TokenRange> ranges(in.U8() % 5);
  for (TokenRange& r : ranges) {
    r.begin = in.Raw<int64_t>();
    r.end = in.Raw<int64_t>();
    r.seq_id = in.Raw<int32_t>();
    r.format = static_cast<PageFormat>(in.U8());
  }
  if (!ValidateRanges(shape.n_tokens, ranges).ok()) return;
  int64_t next = 0;
  for (const TokenRange& r : ranges) {
    if (r.begin != next || r.end <= r.begin || !IsValidPageFormat(static_cast<int>(r.format))) {
      Fail("ValidateRanges accepted ranges that do not tile [0, N)");
    }
    next = r.end;
  }
  if (next != shape.n_tokens) Fail("ValidateRanges accepted ranges that do not end at N");
}

void EntryOverArbitraryBytes(Reader& in) {
  LayerShape shape;
  shape.head_dim = 16 << (in.U8() % 5);
  // Sizes reach every path at the least work: two heads (per-head offsets), ranges of one page and
  // a partial one (80 tokens: pages end mid-range and mid-page). The attention's work is per page,
  // so longer ranges and a third head only repeat it (H ≤ 3 and 160 tokens ran at ~390 execs/s).
  shape.n_heads = 1 + in.U8() % kMaxHeads;
  shape.hidden = shape.n_heads * shape.head_dim;
  std::vector<TokenRange> ranges(1 + in.U8() % 4);
  int64_t begin = 0;
  for (TokenRange& r : ranges) {
    r.begin = begin;
    r.end = begin + 1 + in.U8() % kMaxRangeTokens;
    r.seq_id = in.U8() % 3;
    r.format = static_cast<PageFormat>(in.U8() % kNumPageFormats);
    begin = r.end;
  }
  shape.n_tokens = begin;
  if (!ValidateShape(shape, false).ok()) Fail("ValidateShape refused a valid shape");
  if (!ValidateRanges(shape.n_tokens, ranges).ok()) Fail("ValidateRanges refused valid ranges");
  const bool causal = in.U8() & 1;
  TransformOptions transforms;
  transforms.rotate = in.U8() & 1;
  transforms.seed = in.Raw<uint64_t>();

  const KvLayout layout = PlanKvLayout(shape, ranges);
  if (layout.total_bytes != KvLayoutBytes(shape, ranges)) Fail("KvLayoutBytes differs from PlanKvLayout");
  const std::vector<PageDesc> pages = BuildPageLayout(ranges);
  if (pages.size() != layout.pages.size()) Fail("page count differs from BuildPageLayout");
  const size_t n_pages = pages.size();
  for (size_t p = 0; p < n_pages; ++p) {
    const PageDesc& page = pages[p];
    if (page.n_valid < 1 || page.n_valid > kPageTokens) Fail("page with n_valid outside 1..64");
    const uint64_t bytes = PageBytes(static_cast<PageFormat>(page.format), shape.head_dim);
    for (int h = 0; h < shape.n_heads; ++h) {
      for (uint64_t off : {layout.k_offsets[h * n_pages + p], layout.v_offsets[h * n_pages + p]}) {
        if (off % 128 != 0 || off + bytes > layout.page_bytes || layout.page_bytes > layout.pages_offset) {
          Fail("page " + std::to_string(p) + " of head " + std::to_string(h) + " outside the page area");
        }
      }
    }
  }

  // The block: arbitrary pages and statistics, the real tables.
  std::vector<uint8_t> block(layout.total_bytes);
  in.Fill(block.data(), block.size());
  WriteKvTables(layout, block.data() + layout.pages_offset);
  const KvEntryView view = MakeKvView(layout, shape, block.data(), transforms);

  std::vector<float> row(shape.head_dim);
  for (int h = 0; h < shape.n_heads; ++h) {
    for (int p = 0; p < view.n_pages; ++p) {
      const PageDesc& page = view.pages[p];
      for (int slot = 0; slot < page.n_valid; ++slot) {
        DecodePageRow(static_cast<PageFormat>(page.format), block.data() + view.k_offsets[h * n_pages + p],
                      shape.head_dim, slot, row.data());
        DecodePageRow(static_cast<PageFormat>(page.format), block.data() + view.v_offsets[h * n_pages + p],
                      shape.head_dim, slot, row.data());
      }
    }
  }

  // Queries over every head: arbitrary stored-form q (from the block's bytes), positions across N.
  const int n = 1 + static_cast<int>(shape.n_tokens % cpu::kQueryTile);
  std::vector<float> q(static_cast<size_t>(n) * shape.head_dim);
  in.Fill(reinterpret_cast<uint8_t*>(q.data()), q.size() * sizeof(float));
  std::vector<int32_t> seq(n);
  std::vector<int64_t> pos(n);
  for (int i = 0; i < n; ++i) {
    seq[i] = i % 3;
    pos[i] = (i * 37) % shape.n_tokens;
  }
  std::vector<float> out(q.size());
  const float scale = cpu::EffectiveScale(AttentionOptions{}, shape.head_dim);
  for (MmaPath mma : {MmaPath::kBf16, MmaPath::kInt8}) {  // both paths' logits (mma_path.h)
    for (int h = 0; h < shape.n_heads; ++h) {
      cpu::AttendTile(view, h, cpu::QueryTile{q.data(), seq.data(), pos.data(), n}, causal, scale, mma, out.data());
    }
  }
}

void RowRoundTrip(Reader& in) {
  const int d = 16 << (in.U8() % 5);
  std::vector<float> x(d);
  float amax = 0.0f;
  for (float& v : x) {
    v = in.Raw<float>();
    if (!std::isfinite(v) || std::fabs(v) > kMaxInput) v = 0.5f;  // the encoders' inputs are finite
    amax = std::fmax(amax, std::fabs(v));
  }
  std::vector<uint8_t> page(PageBytes(PageFormat::kBf16, d));  // the largest format
  std::vector<float> y(d);
  for (int f = 0; f < kNumPageFormats; ++f) {
    const PageFormat format = static_cast<PageFormat>(f);
    const int slot = in.U8() % kPageTokens;
    EncodePageRow(format, x.data(), d, slot, page.data());
    DecodePageRow(format, page.data(), d, slot, y.data());
    float step = 0.0f;  // one quantization step (fp16 scale as stored)
    if (format != PageFormat::kBf16) {
      uint16_t scale_bits;
      std::memcpy(&scale_bits, page.data() + MetaOffset(format, d) + slot * MetaBytesPerRow(format), 2);
      step = HalfToFloat(scale_bits);
    }
    for (int i = 0; i < d; ++i) {
      const float tolerance = format == PageFormat::kBf16
                                  ? std::fmax(std::fabs(x[i]) * kBf16RelTolerance, kBf16SubnormalHalfStep)
                              : format == PageFormat::kInt8 ? kInt8HalfStep * step
                                                            : step + kMetaRelTolerance * amax + kLoSubnormalRounding;
      if (!(std::fabs(y[i] - x[i]) <= tolerance)) {
        Fail("format " + std::to_string(f) + " d " + std::to_string(d) + ": x[" + std::to_string(i) + "] = " +
             std::to_string(x[i]) + " decodes to " + std::to_string(y[i]));
      }
    }
  }
}

}  // namespace
}  // namespace kvpack

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvpack::Reader in(data, size);
  switch (in.U8() % 3) {
    case 0: kvpack::RawValidation(in); break;
    case 1: kvpack::EntryOverArbitraryBytes(in); break;
    case 2: kvpack::RowRoundTrip(in); break;
  }
  return 0;
}
