// The format's rotation R = H_d · diag(s) / √d (format.h), host and device.
//
// H_d is the Sylvester Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, −H_n]]), symmetric, with
// H_d·H_d = d·I, so R is orthogonal: Rᵀ = diag(s) · H_d / √d. s is a ±1 vector drawn from the entry's
// 64-bit seed with SplitMix64, bit i of the stream giving s_i (bit set → −1). One sign vector serves
// every head of an entry.
//
// Applying R costs d·log2(d) additions with the in-place fast Walsh–Hadamard transform below; the
// butterfly order is fixed, so host and device round identically when both run it in fp32.
#pragma once

#include <cstdint>

#include "kernels/format.h"

namespace kvpack {

KVPACK_HD inline uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Sign i of the rotation drawn from `seed`: +1.0f or −1.0f. Cheap enough to call per channel.
KVPACK_HD inline float RotationSign(uint64_t seed, int i) {
  uint64_t state = seed + static_cast<uint64_t>(i / 64) * 0x9e3779b97f4a7c15ull;
  const uint64_t word = SplitMix64(&state);
  return (word >> (i % 64)) & 1ull ? -1.0f : 1.0f;
}

KVPACK_HD constexpr bool IsPowerOfTwo(int v) { return v > 0 && (v & (v - 1)) == 0; }

// In-place unnormalised Walsh–Hadamard transform: x ← H_d · x. REQUIRES: d a power of two.
KVPACK_HD inline void WalshHadamard(float* x, int d) {
  for (int len = 1; len < d; len <<= 1) {
    for (int i = 0; i < d; i += 2 * len) {
      for (int j = i; j < i + len; ++j) {
        const float a = x[j];
        const float b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
}

// x ← R · x = H · (s ⊙ x) / √d.
KVPACK_HD inline void RotateForward(float* x, int d, uint64_t seed) {
  for (int i = 0; i < d; ++i) x[i] *= RotationSign(seed, i);
  WalshHadamard(x, d);
  const float norm = 1.0f / sqrtf(static_cast<float>(d));
  for (int i = 0; i < d; ++i) x[i] *= norm;
}

// x ← Rᵀ · x = s ⊙ (H · x) / √d.
KVPACK_HD inline void RotateInverse(float* x, int d, uint64_t seed) {
  WalshHadamard(x, d);
  const float norm = 1.0f / sqrtf(static_cast<float>(d));
  for (int i = 0; i < d; ++i) x[i] *= norm * RotationSign(seed, i);
}

}  // namespace kvpack
