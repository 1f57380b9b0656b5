// Fuzz target: the .npy reader of kvpack-eval (tools/kvpack_eval/npy.h) on arbitrary file images.
// Accepted files must hold exactly prod(shape) values with non-negative dimensions; refusals must
// say why, prefixed with the file's name.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tools/kvpack_eval/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  kvpack::tools::NpyArray array;
  std::string error;
  if (!kvpack::tools::ParseNpy(bytes, "fuzz.npy", &array, &error)) {
    if (error.rfind("fuzz.npy: ", 0) != 0 || error.size() <= 10) {
      std::fprintf(stderr, "npy_fuzz: refusal without a message: '%s'\n", error.c_str());
      std::abort();
    }
    return 0;
  }
  uint64_t count = 1;
  for (int64_t dim : array.shape) {
    if (dim < 0) std::abort();
    count *= static_cast<uint64_t>(dim);
  }
  if (count != array.data.size()) {
    std::fprintf(stderr, "npy_fuzz: shape holds %llu values, the array %zu\n", static_cast<unsigned long long>(count),
                 array.data.size());
    std::abort();
  }
  return 0;
}
