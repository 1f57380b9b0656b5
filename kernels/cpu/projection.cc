#include "kernels/cpu/projection.h"

#include "kernels/format.h"

namespace kvpack::cpu {

float DotBf16(const uint16_t* a, const uint16_t* b, int n) {
  constexpr int kLanes = 8;
  float s[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) s[l] += Bf16ToFloat(a[i + l]) * Bf16ToFloat(b[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) s[l] += Bf16ToFloat(a[i]) * Bf16ToFloat(b[i]);
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

void ProjectRow(const uint16_t* x_row, const uint16_t* w, int hidden, int64_t col_begin, int64_t n_cols,
                uint16_t* out) {
  for (int64_t j = 0; j < n_cols; ++j) {
    out[j] = FloatToBf16(DotBf16(x_row, w + (col_begin + j) * hidden, hidden));
  }
}

}  // namespace kvpack::cpu
