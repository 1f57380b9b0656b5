// Device memory for the pool through CUDA virtual memory management (DESIGN.md §5).
//
// One virtual range is reserved once; physical memory is created and mapped in 2 MiB chunks (the
// device's allocation granularity) only under live allocations. Chunks left idle stay mapped (the next
// request of the same size maps nothing) until Trim(), which unmaps them while the mapped total is
// above `keep_mapped_bytes`, so a frontend on the same GPU gets them back; the engine trims once the
// daemon has been idle for a second.
// Allocations are first-fit in the virtual range, so a freed hole is reused without touching physical
// memory; two allocations may share a chunk (refcounted).
//
// The driver API is reached through cudaGetDriverEntryPointByVersion: the binary links no libcuda and
// still starts on a machine without a driver (MakeVmmArena then returns null with the reason).
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "server/core/pool.h"

namespace kvpack::server {

struct VmmArenaOptions {
  int device = 0;
  uint64_t reserve_bytes = 0;          // virtual range; rounded up to whole chunks
  uint64_t keep_mapped_bytes = 0;      // idle chunks stay mapped up to this total
};

// Null (with `why` set) when the driver lacks VMM support or the reservation fails.
std::unique_ptr<Arena> MakeVmmArena(const VmmArenaOptions& options, std::string* why);

}  // namespace kvpack::server
