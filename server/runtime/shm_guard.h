// Keeps a POSIX shared-memory object that its owner truncates from crashing the daemon.
//
// A mapping of a shm object faults with SIGBUS on any access past the object's current end, and
// the owner (a frontend) can ftruncate the object at any time, also while a layer reads it. The
// registry checks the object's size with fstat at every use (Region::Slice); this guard covers the
// window after that check: a SIGBUS inside a guarded range replaces the range, from the faulting
// page on, with anonymous zero pages (MAP_FIXED), marks the range faulted and lets the access
// retry. The request that used it then fails (FAILED_PRECONDITION) instead of the process dying.
// libwayland-server guards client shm pools the same way. A SIGBUS outside every guarded range
// keeps its default action (the process dies as before).
//
// Thread safety: Guard/Unguard from any thread; the handler is async-signal-safe (a fixed table of
// atomics, mmap). At most kMaxGuardedRanges ranges at once: Guard fails beyond that (the registry's
// --max_regions limit keeps the daemon well below it).
#pragma once

#include <cstdint>

namespace kvpack::server {

inline constexpr int kMaxGuardedRanges = 1 << 16;

// Installs the SIGBUS handler once (idempotent).
void InstallShmGuard();
// Guards [base, base + size); returns a slot id ≥ 0, or -1 when the table is full.
int GuardRange(uint8_t* base, uint64_t size);
// Stops guarding slot `id` (before the range is unmapped).
void UnguardRange(int id);
// Whether a SIGBUS hit slot `id` since it was guarded.
bool RangeFaulted(int id);

}  // namespace kvpack::server
