#include "server/runtime/shm_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace kvpack::server {
namespace {

struct Slot {
  std::atomic<uintptr_t> base{0};  // 0: free
  std::atomic<uint64_t> size{0};
  std::atomic<bool> faulted{false};
};

// Static storage: the handler may run before or after anything else is built or torn down.
Slot g_slots[kMaxGuardedRanges];
std::atomic<int> g_high{0};  // slots [0, g_high) may be in use
struct sigaction g_previous;
uintptr_t g_page = 4096;  // set before the handler is installed (sysconf is not async-signal-safe)

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const int high = g_high.load(std::memory_order_acquire);
  for (int i = 0; i < high; ++i) {
    const uintptr_t base = g_slots[i].base.load(std::memory_order_acquire);
    const uint64_t size = g_slots[i].size.load(std::memory_order_acquire);
    if (base <= 1 || addr < base || addr - base >= size) continue;  // free or being claimed
    const uintptr_t from = addr & ~(g_page - 1);
    void* p = mmap(reinterpret_cast<void*>(from), base + size - from, PROT_READ | PROT_WRITE,
                   MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) break;
    g_slots[i].faulted.store(true, std::memory_order_release);
    return;  // the access retries on the zero pages
  }
  // Not ours: the previous disposition (by default, death with SIGBUS as before).
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);
  raise(sig);  // delivered on return (blocked while the handler runs): the default action kills
}

}  // namespace

void InstallShmGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &g_previous);
  });
}

int GuardRange(uint8_t* base, uint64_t size) {
  InstallShmGuard();
  constexpr uintptr_t kClaimed = 1;  // a slot being filled; the handler skips it
  for (int i = 0; i < kMaxGuardedRanges; ++i) {
    uintptr_t expected = 0;
    if (!g_slots[i].base.compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel)) continue;
    g_slots[i].size.store(size, std::memory_order_release);
    g_slots[i].faulted.store(false, std::memory_order_release);
    g_slots[i].base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    int high = g_high.load();
    while (high < i + 1 && !g_high.compare_exchange_weak(high, i + 1)) {
    }
    return i;
  }
  return -1;
}

void UnguardRange(int id) {
  if (id < 0 || id >= kMaxGuardedRanges) return;
  g_slots[id].base.store(0, std::memory_order_release);
}

bool RangeFaulted(int id) {
  return id >= 0 && id < kMaxGuardedRanges && g_slots[id].faulted.load(std::memory_order_acquire);
}

}  // namespace kvpack::server
