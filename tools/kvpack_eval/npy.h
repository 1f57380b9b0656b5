// NumPy .npy files of float32 values (format versions 1.0, 2.0 and 3.0), C order, little-endian.
//
// Layout: "\x93NUMPY", major, minor, header length (uint16 LE for 1.x, uint32 LE for 2.x/3.x), an
// ASCII Python dict {'descr': '<f4', 'fortran_order': False, 'shape': (…), } padded with spaces and
// a newline, then the raw values. Anything else (another dtype, Fortran order, a big-endian float,
// a shape whose data is not all there) is refused with a message that says which.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvpack::tools {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;  // prod(shape) values, C order
};

// Reads `path`. On failure returns false and sets *error ("K.npy: dtype '<f8' is not float32 …").
bool ReadNpy(const std::string& path, NpyArray* out, std::string* error);

// Parses an in-memory file image (ReadNpy's work, testable without files). `name` prefixes errors.
bool ParseNpy(const std::string& bytes, const std::string& name, NpyArray* out, std::string* error);

// Writes a version 1.0 file. Returns false if the file cannot be written.
bool WriteNpy(const std::string& path, const std::vector<int64_t>& shape, const std::vector<float>& data);

}  // namespace kvpack::tools
