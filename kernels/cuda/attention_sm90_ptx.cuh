// PTX wrappers of the sm90 attention kernel (sm_90a only): wgmma, mbarriers and bulk copies, named
// barriers, setmaxnreg, the exponential, and the 128-byte swizzled layout wgmma reads. Internal to
// kernels/cuda: include only from .cu files.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"

namespace kvpack::cuda::sm90 {

// ── Shared-memory layout ────────────────────────────────────────────────────────────────────────
// Byte offset of channels c8·8 … c8·8 + 7 of row r in a [rows][kDim] bf16 tile with the 128-byte swizzle:
// 64-channel column blocks of rows·128 bytes each; inside one, row r's 128 bytes sit at r·128 and
// their 16-byte chunk j at (j ⊕ (r mod 8))·16, which spreads 8 consecutive rows' chunk j over all 32
// banks. This is the canonical K-major layout of wgmma (Q, K) and, read with keys as K and channels
// as N, its MN-major layout (V).
template <int kRows>
__device__ __forceinline__ int SwizzledOffset(int r, int c8) {
  return (c8 >> 3) * (kRows * 128) + r * 128 + (((c8 & 7) ^ (r & 7)) << 4);
}

// Shared-memory matrix descriptor: start address, leading and stride byte offsets (in 16-byte
// units), 128-byte swizzle (layout type 1 in bits 62–63). Descriptors step by adding (byte offset >> 4)
// to their address field: shared addresses stay below 2^18, so the 14-bit field never carries.
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}

// ── wgmma ───────────────────────────────────────────────────────────────────────────────────────
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending of this warp group's committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory"); }
// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous MMA.
template <int kN>
__device__ __forceinline__ void FenceRegs(float (&r)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[n][e])::"memory");
  }
}
template <int kN>
__device__ __forceinline__ void FenceRegs(uint32_t (&r)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[n][e])::"memory");
  }
}

#define KVPACK_R8(a, i) "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3]), \
                        "+r"(a[i + 1][0]), "+r"(a[i + 1][1]), "+r"(a[i + 1][2]), "+r"(a[i + 1][3])
#define KVPACK_F8(a, i) "+f"(a[i][0]), "+f"(a[i][1]), "+f"(a[i][2]), "+f"(a[i][3]), \
                        "+f"(a[i + 1][0]), "+f"(a[i + 1][1]), "+f"(a[i + 1][2]), "+f"(a[i + 1][3])

// s[64 × 64] (+)= A[64 × 16] · B[16 × 64]; A and B K-major in shared memory. scale_d = 0 overwrites.
__device__ __forceinline__ void WgmmaSS64(float (&s)[8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : KVPACK_F8(s, 0), KVPACK_F8(s, 2), KVPACK_F8(s, 4), KVPACK_F8(s, 6)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
}

// s[64 × 64] (+)= A[64 × 32] · B[32 × 64] in int8 → int32, exactly; A and B K-major in shared memory
// (8-bit operands have no transposed form). The INT8 MMA path's S: Q codes × K codes (INT4 codes 0…15
// are int8 values too, so both page formats take this one instruction).
__device__ __forceinline__ void WgmmaSS64Int8(uint32_t (&s)[8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p;\n}\n"
      : KVPACK_R8(s, 0), KVPACK_R8(s, 2), KVPACK_R8(s, 4), KVPACK_R8(s, 6)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
}

// o[64 × kN·8] += A[64 × 16] · B[16 × kN·8]; A in registers (the m16n8k16 A fragment of each warp's
// 16 rows), B MN-major in shared memory (transposed: imm-trans-b = 1).
__device__ __forceinline__ void WgmmaRS(float (&o)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : KVPACK_F8(o, 0), KVPACK_F8(o, 2), KVPACK_F8(o, 4), KVPACK_F8(o, 6)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
      : "memory");
}
__device__ __forceinline__ void WgmmaRS(float (&o)[16][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : KVPACK_F8(o, 0), KVPACK_F8(o, 2), KVPACK_F8(o, 4), KVPACK_F8(o, 6),
        KVPACK_F8(o, 8), KVPACK_F8(o, 10), KVPACK_F8(o, 12), KVPACK_F8(o, 14)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
      : "memory");
}
#undef KVPACK_F8
#undef KVPACK_R8

// ── Warp-group registers and barriers ───────────────────────────────────────────────────────────
// Moves this warp group's register allocation to kCount per thread (a multiple of 8 in 24…256);
// every warp of the group executes it.
template <int kCount, bool kIncrease>
__device__ __forceinline__ void SetMaxRegisters() {
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount));
  }
}

// Named barriers: `count` threads (a multiple of 32) take part; arrive does not wait.
__device__ __forceinline__ void BarSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void BarArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Orders this thread's ordinary shared-memory stores before later wgmma reads of them.
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ── mbarriers and bulk copies (TMA) ─────────────────────────────────────────────────────────────
// The raw stages fill by bulk copies that complete on an mbarrier: one thread starts a page's two
// copies with the byte count expected, every producer thread waits for the phase.
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarInitFence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void MbarExpectBytes(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// One arrival (release: this thread's earlier shared-memory stores are visible to whoever waits).
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

}  // namespace kvpack::cuda::sm90
