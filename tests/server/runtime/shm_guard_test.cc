// The SIGBUS guard: an access past the end of a truncated shared-memory object reads zero pages and
// marks the range, instead of killing the process.
#include "server/runtime/shm_guard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <string>

namespace kvpack::server {
namespace {

constexpr uint64_t kBytes = 3 * 4096 + 100;  // odd: the object does not end on a page

TEST(ShmGuard, ATruncatedObjectReadsZerosAndIsMarked) {
  const std::string name = "/kvpack-shm-guard-test-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  shm_unlink(name.c_str());
  ASSERT_EQ(ftruncate(fd, kBytes), 0);
  auto* base = static_cast<uint8_t*>(mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(base, MAP_FAILED);
  for (uint64_t i = 0; i < kBytes; ++i) base[i] = static_cast<uint8_t>(i * 7 + 3);
  const int slot = GuardRange(base, kBytes);
  ASSERT_GE(slot, 0);
  EXPECT_FALSE(RangeFaulted(slot));

  ASSERT_EQ(ftruncate(fd, 4096), 0);  // the owner keeps one page
  EXPECT_EQ(base[10], static_cast<uint8_t>(10 * 7 + 3));  // still backed
  volatile uint8_t* past = base + 2 * 4096 + 5;
  EXPECT_EQ(*past, 0);  // SIGBUS without the guard
  *past = 42;           // and writable
  EXPECT_EQ(*past, 42);
  EXPECT_TRUE(RangeFaulted(slot));

  UnguardRange(slot);
  munmap(base, kBytes);
  close(fd);
}

TEST(ShmGuard, SlotsAreReused) {
  uint8_t bytes[64];
  const int a = GuardRange(bytes, sizeof(bytes));
  ASSERT_GE(a, 0);
  UnguardRange(a);
  const int b = GuardRange(bytes, sizeof(bytes));
  EXPECT_EQ(a, b);
  EXPECT_FALSE(RangeFaulted(b));  // a reused slot starts clean
  UnguardRange(b);
}

TEST(ShmGuardDeathTest, ASigbusOutsideEveryRangeStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        InstallShmGuard();
        raise(SIGBUS);
      },
      "");
}

}  // namespace
}  // namespace kvpack::server
