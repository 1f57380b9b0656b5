// A lane: the same-host path of the unary layer calls (AttentionLayerRegions, ProjectRegions,
// AttendRegions) through a POSIX shared-memory region instead of a gRPC round trip. The layout
// below is part of the API, as kvpack.proto is; the Python client mirrors it (kvpack/lane.py) and
// docs/api.md ("Lanes") describes the protocol.
//
// Why: between two attention calls of a diffusion step both processes sleep for the whole
// attention (tens of ms). Waking gRPC's threads on both sides then costs more than the round trip
// itself (session 17 on the H200 host: 0.37 ms back to back, 0.88 ms after 18 ms idle; this 2-core
// VM: 0.10 / 0.63 ms). On a lane the daemon's lane thread and the caller spin on a sequence word
// for a bounded time and only then sleep on a futex, so a call that comes within the spin window
// is seen in microseconds.
//
// The region (registered with RegisterRegion, REGION_SHM, then named in OpenLane):
//
//   byte 0       64              128             192            4096          4096 + R        4096 + R + A
//   ┌────────────┬───────────────┬───────────────┬──────────────┬─────────────┬─────────────┐
//   │ identity   │ client line   │ daemon line   │ (reserved)   │ request     │ answer      │
//   │ (client,   │ (client       │ (daemon       │              │ area, R     │ area, A     │
//   │ before     │ writes)       │ writes)       │              │ bytes       │ bytes       │
//   │ OpenLane)  │               │               │              │             │             │
//   └────────────┴───────────────┴───────────────┴──────────────┴─────────────┴─────────────┘
//
//   identity     u32 magic = kLaneMagic, u32 version = kLaneVersion, u32 R, u32 A; read once, at
//                OpenLane (the daemon keeps its own copy: later writes there change nothing)
//   client line  u32 request_seq  bumped (+1, wrapping, never 0 after the first call) after the
//                                 request and the fields below are written
//                u32 method       LaneMethod
//                u32 request_bytes  the serialized LayerHeader's size, ≤ R
//                u32 timeout_us   the call's deadline from the daemon's reading of the request;
//                                 0: none
//                u32 cancel_seq   = request_seq: cancel that call (it still gets an answer)
//   daemon line  u32 answer_seq   = the request_seq answered, written after the fields below
//                u32 code         a grpc::StatusCode (0 OK)
//                u32 answer_bytes OK: the serialized LayerResult; else the error message (UTF-8)
//                u32 state        LaneState
//
// Every field is little-endian, naturally aligned, and read and written as a whole (atomically);
// the sequence words are the only ones a side waits on (spin, then FUTEX_WAIT on the shared
// mapping; each side FUTEX_WAKEs the other's word after bumping it). A lane carries one call at a
// time: a request sent before the last answer is read when that answer has been written.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cstdint>

namespace kvpack::v1::lane {

inline constexpr uint32_t kLaneMagic = 0x4e4c564b;  // "KVLN" in the region's bytes
inline constexpr uint32_t kLaneVersion = 1;

// Byte offsets of the fields (u32 each).
inline constexpr uint64_t kMagic = 0;
inline constexpr uint64_t kVersion = 4;
inline constexpr uint64_t kRequestArea = 8;
inline constexpr uint64_t kAnswerArea = 12;
inline constexpr uint64_t kRequestSeq = 64;
inline constexpr uint64_t kMethod = 68;
inline constexpr uint64_t kRequestBytes = 72;
inline constexpr uint64_t kTimeoutUs = 76;
inline constexpr uint64_t kCancelSeq = 80;
inline constexpr uint64_t kAnswerSeq = 128;
inline constexpr uint64_t kCode = 132;
inline constexpr uint64_t kAnswerBytes = 136;
inline constexpr uint64_t kState = 140;
// The request area starts here; the answer area follows it.
inline constexpr uint64_t kAreasAt = 4096;

// Bounds on R and A (OpenLane answers INVALID_ARGUMENT outside them). 4 MiB is gRPC's default
// receive limit: no lane message is larger than the unary call would take.
inline constexpr uint32_t kMinArea = 4096;
inline constexpr uint32_t kMaxArea = 4u << 20;

enum LaneMethod : uint32_t {
  kAttentionLayerRegions = 0,
  kProjectRegions = 1,
  kAttendRegions = 2,
};

enum LaneState : uint32_t {
  kStateNone = 0,    // before OpenLane
  kStateOpen = 1,    // the daemon's lane thread serves requests
  kStateClosed = 2,  // closed (CloseLane, the region unregistered, idle past the lease, draining):
                     // the call in flight, if any, was answered first; open another lane or use gRPC
};

// The fields as both sides touch them (the daemon's lane.cc and client/lane.cc; kvpack/lane.py
// does the same through ctypes). Whole-word atomic accesses: acquire on the sequence words a side
// waits on, release on the ones it bumps after writing the rest. REQUIRES: `base` is the region's
// first byte (page-aligned, so every field is aligned).
inline uint32_t Load(const uint8_t* base, uint64_t at) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(base + at), __ATOMIC_ACQUIRE);
}
inline void Store(uint8_t* base, uint64_t at, uint32_t value) {
  __atomic_store_n(reinterpret_cast<uint32_t*>(base + at), value, __ATOMIC_RELEASE);
}
// Shared (not FUTEX_PRIVATE) futexes: the other side is another process mapping the same object.
// A wake or wait on an address that is no longer mapped fails with EFAULT and does nothing else.
inline void FutexWake(uint8_t* base, uint64_t at) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(base + at), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
// Sleeps while the word at `at` holds `expected`, `limit` at most (a wake, a change or a signal
// ends it sooner).
inline void FutexWait(uint8_t* base, uint64_t at, uint32_t expected, const timespec& limit) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(base + at), FUTEX_WAIT, expected, &limit, nullptr, 0);
}

}  // namespace kvpack::v1::lane
