#include "tools/kvpack_eval/npy.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

namespace kvpack::tools {
namespace {

// A version-1.0 image with `dict` as header and `n_floats` values 0.5, 1.5, …
std::string Image(const std::string& dict, size_t n_floats, int major = 1) {
  std::string header = dict + "\n";
  std::string out = std::string("\x93NUMPY", 6) + static_cast<char>(major) + '\0';
  if (major == 1) {
    out += static_cast<char>(header.size() & 0xff);
    out += static_cast<char>(header.size() >> 8);
  } else {
    for (int i = 0; i < 4; ++i) out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  }
  out += header;
  for (size_t i = 0; i < n_floats; ++i) {
    const float f = 0.5f + static_cast<float>(i);
    out.append(reinterpret_cast<const char*>(&f), 4);
  }
  return out;
}

TEST(Npy, ParsesVersionsOneAndTwo) {
  for (int major : {1, 2, 3}) {
    NpyArray a;
    std::string error;
    ASSERT_TRUE(ParseNpy(Image("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2, 2), }", 12, major), "x", &a, &error))
        << error;
    EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 2, 2}));
    ASSERT_EQ(a.data.size(), 12u);
    EXPECT_EQ(a.data[11], 11.5f);
  }
}

TEST(Npy, OneDimensionalShapeWithTrailingComma) {
  NpyArray a;
  std::string error;
  ASSERT_TRUE(ParseNpy(Image("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", 5), "x", &a, &error)) << error;
  EXPECT_EQ(a.shape, (std::vector<int64_t>{5}));
}

TEST(Npy, RefusesWhatItCannotRead) {
  const struct {
    std::string bytes;
    const char* needle;
  } cases[] = {
      {"hello world, not numpy", "not a NumPy .npy file"},
      {Image("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", 4), "dtype '<f8'"},
      {Image("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 2), "dtype '>f4'"},
      {Image("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", 4), "Fortran order"},
      {Image("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4), }", 15), "truncated"},
      {Image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 3), "unexpected bytes"},
      {Image("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 2, 7), "version 7"},
      {Image("{'descr': '<f4', 'fortran_order': False}", 0), "no 'shape'"},
      {Image("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", 0), "bad dimension"},
  };
  for (const auto& c : cases) {
    NpyArray a;
    std::string error;
    EXPECT_FALSE(ParseNpy(c.bytes, "K.npy", &a, &error)) << c.needle;
    EXPECT_NE(error.find(c.needle), std::string::npos) << "wanted '" << c.needle << "' in: " << error;
    EXPECT_EQ(error.rfind("K.npy: ", 0), 0u) << error;
  }
}

TEST(Npy, WriteThenReadRoundTrips) {
  const std::string path = ::testing::TempDir() + "npy_test_roundtrip.npy";
  const std::vector<float> data = {1.0f, -2.5f, 3.25f, 1e-3f, 7.0f, -0.0f};
  ASSERT_TRUE(WriteNpy(path, {3, 1, 2}, data));
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ((bytes.size() - data.size() * 4) % 64, 0u);  // header padded to 64 bytes like NumPy
  NpyArray a;
  std::string error;
  ASSERT_TRUE(ReadNpy(path, &a, &error)) << error;
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 1, 2}));
  EXPECT_EQ(a.data, data);
  std::remove(path.c_str());
  EXPECT_FALSE(ReadNpy(path, &a, &error));
  EXPECT_NE(error.find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace kvpack::tools
