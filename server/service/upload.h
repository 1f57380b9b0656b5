// The client-streamed upload protocol shared by RegisterWeights and the layer calls: a header
// message first, then chunks of the inline tensors it announced.
#pragma once

#include <new>
#include <utility>

#include "absl/status/status.h"

namespace kvpack::server {

// Routes one received message to `on_header` or `on_chunk`, rejecting a second header, a chunk
// before the header, and a message that is neither. `Message` is a proto with a `header`/`chunk`
// oneof (v1::WeightsRequest, v1::LayerRequest).
template <typename Message, typename OnHeader, typename OnChunk>
absl::Status DispatchUpload(const Message& in, bool have_header, OnHeader&& on_header, OnChunk&& on_chunk) {
  if (in.has_header()) {
    return have_header ? absl::InvalidArgumentError("header: sent twice") : on_header(in.header());
  }
  if (in.has_chunk()) {
    return have_header ? on_chunk(in.chunk()) : absl::InvalidArgumentError("header: must come before any chunk");
  }
  return absl::InvalidArgumentError("message: neither header nor chunk");
}

// Runs `body` (returning absl::Status) and turns a std::bad_alloc from it into RESOURCE_EXHAUSTED:
// an exception must not escape a gRPC callback (the call would never finish; see issue 16).
template <typename Body>
absl::Status CatchAllocationFailure(Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("the daemon ran out of host memory for this call");
  }
}

}  // namespace kvpack::server
