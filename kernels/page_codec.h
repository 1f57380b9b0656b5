// The page codecs of format v1, host twin: one PageCodec<F> per format with its sizes and the scalar
// reference encode and decode of one row (format.h draws the bytes). Host and device code alike
// (KVPACK_HD); the CPU backend packs and reads pages through these, and the GPU tests compare the
// CUDA kernels' pages with them. The device twin is cuda/page_codec.cuh.
//
// A codec answers, for a row of head_dim values:
//   CodeBytes(d)    bytes of the row's codes          kMetaBytes   bytes of its metadata
//   EncodeRow       float[d] → codes + metadata       DecodeRow    codes + metadata → float[d]
// The functions over a runtime PageFormat at the end (PageBytes, EncodePageRow, …) reach the codecs
// through DispatchFormat, so a format without a codec fails to compile wherever it is used.
#pragma once

#include "kernels/format.h"

namespace kvpack {

// No codec: a format without a specialisation below is a compile error wherever it is dispatched.
template <PageFormat F>
struct PageCodec;

template <>
struct PageCodec<PageFormat::kInt4> {
  using Meta = Int4RowMeta;
  static constexpr int kMetaBytes = sizeof(Meta);
  KVPACK_HD static constexpr int CodeBytes(int head_dim) { return head_dim / 2; }
  KVPACK_HD static void EncodeRow(const float* x, int head_dim, uint8_t* codes, uint8_t* meta) {
    Meta m;
    EncodeRowInt4(x, head_dim, codes, &m);
    memcpy(meta, &m, sizeof(m));
  }
  KVPACK_HD static void DecodeRow(const uint8_t* codes, const uint8_t* meta, int head_dim, float* out) {
    Meta m;
    memcpy(&m, meta, sizeof(m));
    DecodeRowInt4(codes, m, head_dim, out);
  }
  // The row as integers: x̂_c = lo + code_c · scale, code_c in 0…15 (the INT8 MMA path's K operand).
  static constexpr bool kIntegerCodes = true;
  KVPACK_HD static void IntegerRow(const uint8_t* codes, const uint8_t* meta, int head_dim, int8_t* out, float* scale,
                                   float* lo) {
    Meta m;
    memcpy(&m, meta, sizeof(m));
    for (int i = 0; i < head_dim; ++i) out[i] = static_cast<int8_t>(i & 1 ? codes[i / 2] >> 4 : codes[i / 2] & 0xf);
    *scale = HalfToFloat(m.scale);
    *lo = HalfToFloat(m.lo);
  }
};

template <>
struct PageCodec<PageFormat::kInt8> {
  using Meta = Int8RowMeta;
  static constexpr int kMetaBytes = sizeof(Meta);
  KVPACK_HD static constexpr int CodeBytes(int head_dim) { return head_dim; }
  KVPACK_HD static void EncodeRow(const float* x, int head_dim, uint8_t* codes, uint8_t* meta) {
    Meta m;
    EncodeRowInt8(x, head_dim, reinterpret_cast<int8_t*>(codes), &m);
    memcpy(meta, &m, sizeof(m));
  }
  KVPACK_HD static void DecodeRow(const uint8_t* codes, const uint8_t* meta, int head_dim, float* out) {
    Meta m;
    memcpy(&m, meta, sizeof(m));
    DecodeRowInt8(reinterpret_cast<const int8_t*>(codes), m, head_dim, out);
  }
  // x̂_c = code_c · scale, code_c in −127…127; lo = 0.
  static constexpr bool kIntegerCodes = true;
  KVPACK_HD static void IntegerRow(const uint8_t* codes, const uint8_t* meta, int head_dim, int8_t* out, float* scale,
                                   float* lo) {
    Meta m;
    memcpy(&m, meta, sizeof(m));
    memcpy(out, codes, head_dim);
    *scale = HalfToFloat(m.scale);
    *lo = 0.0f;
  }
};

template <>
struct PageCodec<PageFormat::kBf16> {
  static constexpr int kMetaBytes = 0;
  KVPACK_HD static constexpr int CodeBytes(int head_dim) { return 2 * head_dim; }
  KVPACK_HD static void EncodeRow(const float* x, int head_dim, uint8_t* codes, uint8_t* /*meta*/) {
    uint16_t tmp[kMaxHeadDimCpu];
    EncodeRowBf16(x, head_dim, tmp);
    memcpy(codes, tmp, 2 * head_dim);
  }
  KVPACK_HD static void DecodeRow(const uint8_t* codes, const uint8_t* /*meta*/, int head_dim, float* out) {
    for (int i = 0; i < head_dim; ++i) {  // byte copies: a row need not be 2-byte aligned in a caller's buffer
      uint16_t b;
      memcpy(&b, codes + 2 * i, 2);
      out[i] = Bf16ToFloat(b);
    }
  }
  // Values, not integer codes: BF16 pages always take bf16 MMAs.
  static constexpr bool kIntegerCodes = false;
  KVPACK_HD static void IntegerRow(const uint8_t*, const uint8_t*, int, int8_t*, float*, float*) {}
};

// ── Sizes of a runtime format ───────────────────────────────────────────────────────────────────

// Bytes of one row's codes.
KVPACK_HD constexpr int CodeBytesPerRow(PageFormat f, int head_dim) {
  return DispatchFormat(f, [&](auto tag) { return PageCodec<decltype(tag)::kFormat>::CodeBytes(head_dim); });
}
// Bytes of one row's metadata.
KVPACK_HD constexpr int MetaBytesPerRow(PageFormat f) {
  return DispatchFormat(f, [](auto tag) { return PageCodec<decltype(tag)::kFormat>::kMetaBytes; });
}
// Byte offset of the metadata block inside a page.
KVPACK_HD constexpr int MetaOffset(PageFormat f, int head_dim) { return kPageTokens * CodeBytesPerRow(f, head_dim); }
KVPACK_HD constexpr int PageBytes(PageFormat f, int head_dim) {
  return kPageTokens * (CodeBytesPerRow(f, head_dim) + MetaBytesPerRow(f));
}
// Bits actually stored per value, metadata included (e.g. INT4 at d = 128: 4.25).
KVPACK_HD constexpr double BitsPerValue(PageFormat f, int head_dim) {
  return 8.0 * (CodeBytesPerRow(f, head_dim) + MetaBytesPerRow(f)) / head_dim;
}

static_assert(PageBytes(PageFormat::kInt4, 128) == 4352, "INT4 page, d=128");
static_assert(PageBytes(PageFormat::kInt8, 128) == 8320, "INT8 page, d=128");
static_assert(PageBytes(PageFormat::kBf16, 128) == 16384, "BF16 page, d=128");
static_assert(PageBytes(PageFormat::kInt4, 64) == 2304, "INT4 page, d=64");
static_assert(PageBytes(PageFormat::kInt8, 64) == 4224, "INT8 page, d=64");
static_assert(PageBytes(PageFormat::kBf16, 64) == 8192, "BF16 page, d=64");
static_assert(PageBytes(PageFormat::kInt4, 128) % 128 == 0 && PageBytes(PageFormat::kInt8, 128) % 128 == 0 &&
                  PageBytes(PageFormat::kInt4, 64) % 128 == 0 && PageBytes(PageFormat::kInt8, 64) % 128 == 0,
              "pages keep 128-byte alignment");

// ── Rows of a page in a runtime format ──────────────────────────────────────────────────────────

// Encodes row `slot` of a page in format f. `page` points at the page's first byte.
KVPACK_HD inline void EncodePageRow(PageFormat f, const float* x, int head_dim, int slot, uint8_t* page) {
  DispatchFormat(f, [&](auto tag) {
    using Codec = PageCodec<decltype(tag)::kFormat>;
    Codec::EncodeRow(x, head_dim, page + slot * Codec::CodeBytes(head_dim),
                     page + MetaOffset(decltype(tag)::kFormat, head_dim) + slot * Codec::kMetaBytes);
  });
}

// Decodes row `slot` of a page in format f into out[head_dim].
KVPACK_HD inline void DecodePageRow(PageFormat f, const uint8_t* page, int head_dim, int slot, float* out) {
  DispatchFormat(f, [&](auto tag) {
    using Codec = PageCodec<decltype(tag)::kFormat>;
    Codec::DecodeRow(page + slot * Codec::CodeBytes(head_dim),
                     page + MetaOffset(decltype(tag)::kFormat, head_dim) + slot * Codec::kMetaBytes, head_dim, out);
  });
}

// Whether rows of format f are integer codes with a per-row scale and offset (IntegerPageRow).
KVPACK_HD constexpr bool HasIntegerCodes(PageFormat f) {
  return DispatchFormat(f, [](auto tag) { return PageCodec<decltype(tag)::kFormat>::kIntegerCodes; });
}
// Row `slot` as integer codes: x̂_c = lo + out[c] · scale. REQUIRES: HasIntegerCodes(f).
KVPACK_HD inline void IntegerPageRow(PageFormat f, const uint8_t* page, int head_dim, int slot, int8_t* out, float* scale,
                                     float* lo) {
  DispatchFormat(f, [&](auto tag) {
    using Codec = PageCodec<decltype(tag)::kFormat>;
    Codec::IntegerRow(page + slot * Codec::CodeBytes(head_dim),
                      page + MetaOffset(decltype(tag)::kFormat, head_dim) + slot * Codec::kMetaBytes, head_dim, out,
                      scale, lo);
  });
}

}  // namespace kvpack
