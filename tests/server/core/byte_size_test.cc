#include "server/core/byte_size.h"

#include <gtest/gtest.h>

namespace kvpack::server {
namespace {

TEST(ByteSize, Suffixes) {
  EXPECT_EQ(ParseByteSize("1234")->bytes, 1234u);
  EXPECT_EQ(ParseByteSize("16G")->bytes, 16000000000u);
  EXPECT_EQ(ParseByteSize("16Gi")->bytes, 16ull << 30);
  EXPECT_EQ(ParseByteSize("512Mi")->bytes, 512ull << 20);
  EXPECT_EQ(ParseByteSize("64KiB")->bytes, 64ull << 10);
  EXPECT_EQ(ParseByteSize("1.5G")->bytes, 1500000000u);
}

TEST(ByteSize, Fraction) {
  absl::StatusOr<ByteSize> f = ParseByteSize("0.8");
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->is_fraction);
  EXPECT_EQ(f->Resolve(1000), 800u);
}

TEST(ByteSize, Rejects) {
  for (const char* bad : {"", "abc", "-5", "12Q", "0", "Gi", "5i"}) {
    EXPECT_FALSE(ParseByteSize(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace kvpack::server
