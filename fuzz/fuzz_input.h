// The fuzz targets' input: protobuf wire bytes, or after a leading 't' protobuf text — byte mutations
// of wire format rarely grow a varint inside nested length-delimited messages (options.rope.axis_dims:
// 56 → 2^30 needs three length prefixes fixed up), while in text they are a few inserted digits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message.h"
#include "google/protobuf/text_format.h"

namespace kvpack::server {

inline bool ParseInput(const uint8_t* data, size_t size, google::protobuf::Message* out) {
  if (size > 0 && data[0] == 't') {
    struct Quiet : google::protobuf::io::ErrorCollector {
      void AddError(int, int, const std::string&) override {}
    } quiet;  // a malformed text is just an input to skip, not worth a log line per exec
    google::protobuf::TextFormat::Parser parser;
    parser.AllowPartialMessage(true);
    parser.RecordErrorsTo(&quiet);
    google::protobuf::io::ArrayInputStream in(data + 1, static_cast<int>(size - 1));
    return parser.Parse(&in, out);
  }
  return out->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace kvpack::server
