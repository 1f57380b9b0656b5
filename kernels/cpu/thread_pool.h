// Fork-join parallel loops for the CPU reference.
//
// ParallelFor runs fn(item) for every item in [0, n_items) on up to n_threads threads (the calling
// thread is one of them) and returns when all are done. Items are handed out by an atomic counter,
// so which thread runs an item varies; callers keep results bit-identical for any thread count by
// making every item write its own outputs and by fixing each item's arithmetic order.
//
// Threads are created per call (a few tens of microseconds): the reference calls ParallelFor once
// per chunk, whose work is milliseconds or more. If the system refuses a thread, the remaining work
// runs on the threads already started (never an exception out of this function).
#pragma once

#include <cstdint>
#include <functional>

namespace kvpack::cpu {

// 0 → std::thread::hardware_concurrency() (at least 1).
int ResolveThreadCount(int requested);

// REQUIRES: fn does not throw. Thread-safe; reentrant (a nested call runs serially on its caller).
void ParallelFor(int n_threads, int64_t n_items, const std::function<void(int64_t item)>& fn);

}  // namespace kvpack::cpu
