#include "tools/kvpack_eval/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

namespace kvpack::tools {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
constexpr size_t kMaxElements = size_t{1} << 34;  // 64 GiB of float32: far past any real input

bool Fail(std::string* error, const std::string& name, const std::string& what) {
  *error = name + ": " + what;
  return false;
}

// The text after `key` and its colon in the header dict, or npos.
size_t ValueStart(const std::string& header, const std::string& key) {
  const size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) return std::string::npos;
  const size_t colon = header.find(':', k);
  if (colon == std::string::npos) return std::string::npos;
  return header.find_first_not_of(' ', colon + 1);
}

}  // namespace

bool ParseNpy(const std::string& bytes, const std::string& name, NpyArray* out, std::string* error) {
  // Preamble: magic, version, header length.
  if (bytes.size() < kMagicLen + 4 || bytes.compare(0, kMagicLen, kMagic, kMagicLen) != 0) {
    return Fail(error, name, "not a NumPy .npy file (no \\x93NUMPY magic)");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8;
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return Fail(error, name, "truncated .npy preamble");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    header_start = 12;
  } else {
    return Fail(error, name, ".npy format version " + std::to_string(major) + " is not supported (1, 2 or 3)");
  }
  if (bytes.size() < header_start + header_len) return Fail(error, name, "truncated .npy header");
  const std::string header = bytes.substr(header_start, header_len);

  // Header dict: descr, fortran_order, shape.
  const size_t descr = ValueStart(header, "descr");
  if (descr == std::string::npos || header[descr] != '\'') return Fail(error, name, "header has no 'descr'");
  const std::string dtype = header.substr(descr + 1, header.find('\'', descr + 1) - descr - 1);
  if (dtype != "<f4") {
    return Fail(error, name, "dtype '" + dtype + "' is not little-endian float32 ('<f4'); convert with .astype(np.float32)");
  }
  const size_t fortran = ValueStart(header, "fortran_order");
  if (fortran == std::string::npos) return Fail(error, name, "header has no 'fortran_order'");
  if (header.compare(fortran, 5, "False") != 0) {
    return Fail(error, name, "array is in Fortran order; save a C-order array (np.ascontiguousarray)");
  }
  const size_t shape_at = ValueStart(header, "shape");
  if (shape_at == std::string::npos || header[shape_at] != '(') return Fail(error, name, "header has no 'shape'");
  const size_t shape_end = header.find(')', shape_at);
  if (shape_end == std::string::npos) return Fail(error, name, "header 'shape' is not closed");
  out->shape.clear();
  std::istringstream dims(header.substr(shape_at + 1, shape_end - shape_at - 1));
  std::string token;
  size_t count = 1;
  while (std::getline(dims, token, ',')) {
    const size_t first = token.find_first_not_of(" L");
    if (first == std::string::npos) continue;  // the trailing comma of (n,)
    char* end = nullptr;
    const long long dim = std::strtoll(token.c_str() + first, &end, 10);
    if (end == token.c_str() + first || dim < 0) return Fail(error, name, "bad dimension '" + token + "' in shape");
    out->shape.push_back(dim);
    if (dim > 0 && count > kMaxElements / static_cast<size_t>(dim)) return Fail(error, name, "shape is too large");
    count *= static_cast<size_t>(dim);
  }

  // Data: exactly prod(shape) float32 values.
  const size_t data_start = header_start + header_len;
  const size_t want = count * sizeof(float);
  const size_t have = bytes.size() - data_start;
  if (have < want) {
    return Fail(error, name, "truncated: shape needs " + std::to_string(want) + " data bytes, the file has " +
                                 std::to_string(have));
  }
  if (have > want) return Fail(error, name, std::to_string(have - want) + " unexpected bytes after the data");
  out->data.resize(count);
  if (count > 0) memcpy(out->data.data(), bytes.data() + data_start, want);  // little-endian host
  return true;
}

bool ReadNpy(const std::string& path, NpyArray* out, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Fail(error, path, "cannot open");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Fail(error, path, "read error");
  return ParseNpy(bytes, path, out, error);
}

bool WriteNpy(const std::string& path, const std::vector<int64_t>& shape, const std::vector<float>& data) {
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
  dict += "), }";
  const size_t unpadded = kMagicLen + 4 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) return false;
  f.write(kMagic, kMagicLen);
  const char version[2] = {1, 0};
  f.write(version, 2);
  const char len[2] = {static_cast<char>(dict.size() & 0xff), static_cast<char>(dict.size() >> 8)};
  f.write(len, 2);
  f << dict;
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * sizeof(float)));
  return static_cast<bool>(f);
}

}  // namespace kvpack::tools
