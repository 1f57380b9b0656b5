// The static shared memory of one sm90 attention CTA, shared by its producer and consumer warp
// groups (the dynamic part — Q, K/V tiles, raw stages — is laid out by Sm90Tile). Internal to
// kernels/cuda: include only from .cu files.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_tile.h"

namespace kvpack::cuda::sm90 {

// How stages change hands:
//   raw stage st   raw_full[st]   mbarrier, one arrival + the bulk copies' bytes   → the decode
//   tile stage s   tile_full[s]   mbarrier, every producer thread arrives          → each consumer group
//                  kEmptyBar + s  named barrier, consumers arrive, producers wait  → the decode
// The descriptors travel beside them: raw_desc[st] from the copying thread to the decode,
// tile_desc[s] from the decode to the consumers.
template <class T>
struct SharedState {
  QueryRuns runs;
  VisibleScratch<T::kThreads, T::kWindow> scratch;
  PageDesc raw_desc[T::kRawStages];
  PageDesc tile_desc[T::kStages];
  uint64_t raw_full[T::kRawStages];
  uint64_t tile_full[T::kStages];
  float4 key_table[T::kStages][kPageTokens / 2];  // (a_j, b_j, a_j+1, b_j+1): the producer's DecodePage
  uint32_t bf16_exponent;                         // kBf16Exponent, see Int4CodesPlus128
};

}  // namespace kvpack::cuda::sm90
