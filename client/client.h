// C++ client of kvpackd (kvpack.v1). Every call carries a deadline (ClientOptions::timeout unless
// the call passes its own), the tenant header and, when set, the bearer token.
//
// Inline tensors are streamed in chunks of kChunkBytes; the output of a layer is received into the
// caller's buffer. Thread safety: a Client may be used from several threads at once (the gRPC
// channel and stub are thread-safe; each call has its own context).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpack/v1/kvpack.grpc.pb.h"

namespace kvpack::client {

inline constexpr uint64_t kChunkBytes = 2ull << 20;

struct ClientOptions {
  std::string address = "127.0.0.1:50051";  // host:port or unix:PATH
  std::string token;                         // bearer token; empty: none
  std::string tenant;                        // x-kvpack-tenant; empty: the daemon's default
  std::string tls_ca_file;                   // non-empty: TLS with this root certificate
  absl::Duration timeout = absl::Seconds(120);
};

// Weights in host memory (RegisterWeights).
struct WeightsData {
  int hidden = 0;
  int n_heads = 0;
  int head_dim = 0;
  const uint16_t* w_qkv = nullptr;  // bf16 [3·H·d, D]
  const float* bias = nullptr;      // [3·H·d] or null
  const float* q_norm = nullptr;    // [norm_len] or null
  const float* k_norm = nullptr;
  int norm_len = 0;
};

// Host tensors of one layer call; each may instead be named by a region in the header.
struct LayerData {
  const void* x = nullptr;          // bf16 [N, D], sent inline when non-null
  const void* positions = nullptr;  // float [N, axes], sent inline when non-null
  void* out = nullptr;              // bf16 [N, H·d], filled from the inline output when non-null
  uint64_t out_capacity = 0;
  // Pre-projected input (header.projected): bf16, each ProjectedBytes(header) bytes, sent inline
  // when non-null and the header leaves that tensor's reference unset.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
};

// Bytes of each of q, k, v that header.projected describes (its layout, row stride, shape).
uint64_t ProjectedBytes(const v1::LayerHeader& header);

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  absl::StatusOr<v1::StatusResponse> Status();
  absl::StatusOr<v1::PlanResponse> Plan(const v1::PlanRequest& request);
  // True when grpc.health.v1 reports SERVING for the whole server.
  absl::StatusOr<bool> Health();

  absl::StatusOr<v1::WeightsResponse> RegisterWeights(const WeightsData& weights);
  absl::Status ReleaseWeights(const std::string& handle);
  absl::Status ReleaseKv(const std::string& handle);

  // Runs AttentionLayer, Project or Attend ("method"). Tensor refs in `header` that are unset are
  // filled in as inline from `data`. `timeout` ≤ 0 uses the client's.
  absl::StatusOr<v1::LayerResult> AttentionLayer(v1::LayerHeader header, const LayerData& data,
                                                 absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::LayerResult> Project(v1::LayerHeader header, const LayerData& data,
                                          absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::LayerResult> Attend(v1::LayerHeader header, const LayerData& data,
                                         absl::Duration timeout = absl::ZeroDuration());

  absl::StatusOr<std::string> RegisterShmRegion(const std::string& shm_name, uint64_t size_bytes);
  absl::Status UnregisterRegion(const std::string& region_id);
  absl::StatusOr<v1::RegionStatusResponse> RegionStatus(const std::string& region_id = "");
  absl::StatusOr<int> KeepAlive(const std::vector<std::string>& ids);

  v1::Kvpack::Stub* stub() { return stub_.get(); }
  // A context with this client's deadline and metadata, for callers that use stub() directly.
  void Prepare(grpc::ClientContext* context, absl::Duration timeout = absl::ZeroDuration()) const;

 private:
  enum class Method { kAttentionLayer, kProject, kAttend };
  absl::StatusOr<v1::LayerResult> RunLayer(Method method, v1::LayerHeader header, const LayerData& data,
                                           absl::Duration timeout);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Kvpack::Stub> stub_;
};

// grpc::Status → absl::Status (same codes, same message).
absl::Status FromGrpc(const grpc::Status& status);

// A POSIX shared-memory object created and mapped by the client; unlinked and unmapped on
// destruction. Pass name() and size() to RegisterShmRegion.
class SharedMemory {
 public:
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(uint64_t size);
  ~SharedMemory();
  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  uint8_t* data() const { return data_; }

 private:
  std::string name_;
  uint64_t size_ = 0;
  uint8_t* data_ = nullptr;
};

}  // namespace kvpack::client
