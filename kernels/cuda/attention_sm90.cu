// Attention over packed pages on Hopper's asynchronous warp-group MMA (wgmma, sm_90a), warp-specialised,
// composed the way FlashAttention-3's hopper/ is:
//   attention_sm90_tile.h       tile configuration: roles, registers, stages, shared-memory plan
//   attention_sm90_ptx.cuh      PTX wrappers (wgmma, mbarriers, bulk copies, named barriers, swizzle)
//   attention_sm90_shared.cuh   the CTA's static shared state and how stages change hands
//   attention_sm90_producer.cuh load + decode: raw pages by bulk copy → swizzled bf16 tiles + key table
//   attention_sm90_consumer.cuh MMA + softmax: S = Q·Kᵀ, masks, online softmax, O += P·V
//   attention_sm90_epilogue.cuh normalise, stage, Rᵀ / ×λ_v / +μ_v, bf16 store
//   attention_device.cuh        the tile scheduler, visibility (the dense policy) and output rows
//   page_codec.cuh              the formats' decoders
// This file is the kernel (prologue, the role split, the window loop) and its launch. bench/RESULTS.md
// has the measurements behind each choice.
#include "kernels/cuda/attention_sm90.h"

#include <type_traits>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_consumer.cuh"
#include "kernels/cuda/attention_sm90_epilogue.cuh"
#include "kernels/cuda/attention_sm90_producer.cuh"
#include "kernels/cuda/attention_sm90_ptx.cuh"
#include "kernels/cuda/attention_sm90_shared.cuh"
#include "kernels/cuda/attention_sm90_tile.h"
#include "kernels/cuda/cuda_status.h"

namespace kvpack::cuda {
namespace {

using namespace sm90;

template <int kDim, int kStages>
__global__ void __launch_bounds__(Sm90Tile<kDim, kStages>::kThreads, 1) AttentionSm90Kernel(const AttentionParams p) {
  using T = Sm90Tile<kDim, kStages>;
  constexpr int kUnitsPerRow = kDim / 8;  // 16-byte chunks per bf16 row
  extern __shared__ uint8_t smem_raw[];
  __shared__ SharedState<T> sh;
  uint8_t* smem = smem_raw + ((T::kAlign - (SmemAddr(smem_raw) & (T::kAlign - 1))) & (T::kAlign - 1));

  // ── Prologue: Q [2 groups][64][d] → swizzled shared memory, mbarriers, the tile's query runs ────
  const int tid = threadIdx.x;
  const int group = tid >> 7;  // 0, 1: producers; 2, 3: consumers
  const QueryTileCoords tile = TileOfBlock(p);
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  for (int u = tid; u < kTileQueries * kUnitsPerRow; u += T::kThreads) {
    const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < tile.n_rows) v = *reinterpret_cast<const uint4*>(p.q + (tile.q0 + r) * p.q_stride + tile.head * kDim + c8 * 8);
    *reinterpret_cast<uint4*>(smem + (r / T::kGroupRows) * (T::kQBytes / 2) + SwizzledOffset<T::kGroupRows>(r % T::kGroupRows, c8)) = v;
  }
  if (tid == 0) {
    sh.bf16_exponent = kBf16Exponent;
    for (int st = 0; st < T::kRawStages; ++st) MbarInit(SmemAddr(&sh.raw_full[st]), 1);
    for (int st = 0; st < T::kStages; ++st) MbarInit(SmemAddr(&sh.tile_full[st]), T::kProducerThreads);
    MbarInitFence();
  }
  FenceProxyAsync();
  FindQueryRuns<T::kThreads>(p, tile.t0, tile.n_rows, sh.runs);  // its barriers also publish Q and the mbarriers

  // ── Main loop: windows of pages; in each, the producer/consumer pipeline over the visible pages ──
  // Each role runs its own copy of the window loop, so that the code after setmaxnreg belongs to one
  // role only (the register counts of the two differ). Both meet at the same CTA barriers.
  const int n_pages = p.kv.n_pages;
  if (group < T::kProducerGroups) {
    SetMaxRegisters<T::kProducerRegisters, false>();
    uint32_t raw_phase = 0;
    const uint32_t exponent = sh.bf16_exponent;
    for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
      const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
      const int n_visible = CollectVisiblePages(p, sh.runs, w0, wn, sh.scratch);
      if (n_visible > 0) ProduceWindow(p, sh, smem, tile.head, w0, n_visible, scale_log2, exponent, raw_phase, tid);
      __syncthreads();  // the consumers are done with the tiles before the next window
    }
    return;
  }
  SetMaxRegisters<T::kConsumerRegisters, true>();
  Consumer<T> consumer(p, sh, smem, tile.t0, tid);
  for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
    const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
    const int n_visible = CollectVisiblePages(p, sh.runs, w0, wn, sh.scratch);
    if (n_visible > 0) consumer.ConsumeWindow(n_visible);
    __syncthreads();  // matches the producer's, before the next window
  }

  // ── Epilogue ─────────────────────────────────────────────────────────────────────────────────
  StoreOutputRows(consumer, tile, tid & 31);
}

// The kernel instance that serves (head_dim, max_page_bytes): f(dim, stages), both as
// std::integral_constant, so that every entry point below makes the same choice.
template <int kValue>
using Int = std::integral_constant<int, kValue>;
template <class F>
auto WithInstance(int head_dim, int max_page_bytes, F&& f) {
  if (head_dim == 128) {
    return Sm90Stages<128>(max_page_bytes) == kSm90DeepStages ? f(Int<128>{}, Int<kSm90DeepStages>{})
                                                               : f(Int<128>{}, Int<2>{});
  }
  return f(Int<64>{}, Int<kSm90DeepStages>{});
}

// Raises the instance's dynamic shared-memory limit to what `max_page_bytes` needs; returns the bytes.
template <int kDim, int kStages>
Error Prepare(int max_page_bytes, int* smem) {
  *smem = Sm90DynamicSmem<kDim, kStages>(max_page_bytes);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(AttentionSm90Kernel<kDim, kStages>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, *smem));
  return Error::Ok();
}

template <int kDim, int kStages>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((Prepare<kDim, kStages>(p.max_page_bytes, &smem)));
  AttentionSm90Kernel<kDim, kStages><<<AttentionGrid(p), Sm90Tile<kDim, kStages>::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention sm90 kernel");
  return Error::Ok();
}

template <int kDim, int kStages>
Error CtasPerSm(const AttentionParams& p, int* ctas) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((Prepare<kDim, kStages>(p.max_page_bytes, &smem)));
  KVPACK_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, AttentionSm90Kernel<kDim, kStages>,
                                                                   Sm90Tile<kDim, kStages>::kThreads, smem));
  return Error::Ok();
}

}  // namespace

int AttentionSm90SharedBytes(int head_dim, int max_page_bytes) {
  return WithInstance(head_dim, max_page_bytes,
                      [&](auto dim, auto stages) { return Sm90DynamicSmem<dim.value, stages.value>(max_page_bytes); });
}

Error LaunchAttentionSm90(const AttentionParams& params, cudaStream_t stream) {
  return WithInstance(params.kv.head_dim, params.max_page_bytes,
                      [&](auto dim, auto stages) { return Launch<dim.value, stages.value>(params, stream); });
}

Error AttentionSm90CtasPerSm(const AttentionParams& params, int* ctas) {
  return WithInstance(params.kv.head_dim, params.max_page_bytes,
                      [&](auto dim, auto stages) { return CtasPerSm<dim.value, stages.value>(params, ctas); });
}

}  // namespace kvpack::cuda
