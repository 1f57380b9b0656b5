#include "client/client.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvpack::client {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto client = std::unique_ptr<Client>(new Client());
  client->options_ = options;
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty()) {
    std::ifstream in(options.tls_ca_file);
    if (!in) return absl::NotFoundError("cannot read " + options.tls_ca_file);
    std::ostringstream pem;
    pem << in.rdbuf();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem.str();
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(8 << 20);
  // Bigger HTTP/2 frames and a deeper window for 2 MiB chunks (see kvpackd's main.cc).
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  client->channel_ = grpc::CreateCustomChannel(options.address, creds, args);
  client->stub_ = v1::Kvpack::NewStub(client->channel_);
  return client;
}

void Client::Prepare(grpc::ClientContext* context, absl::Duration timeout) const {
  const absl::Duration t = timeout > absl::ZeroDuration() ? timeout : options_.timeout;
  context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(t));
  if (!options_.tenant.empty()) context->AddMetadata("x-kvpack-tenant", options_.tenant);
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
}

absl::StatusOr<v1::StatusResponse> Client::Status() {
  grpc::ClientContext context;
  Prepare(&context);
  v1::StatusResponse response;
  if (absl::Status s = FromGrpc(stub_->Status(&context, v1::StatusRequest(), &response)); !s.ok()) return s;
  return response;
}

absl::StatusOr<v1::PlanResponse> Client::Plan(const v1::PlanRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::PlanResponse response;
  if (absl::Status s = FromGrpc(stub_->Plan(&context, request, &response)); !s.ok()) return s;
  return response;
}

absl::StatusOr<bool> Client::Health() {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  Prepare(&context);
  grpc::health::v1::HealthCheckResponse response;
  if (absl::Status s = FromGrpc(stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response)); !s.ok()) {
    return s;
  }
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

namespace {

// Streams `bytes` of `data` as chunks of `tensor`; false when the stream broke.
template <typename Writer, typename Message>
bool SendChunks(Writer* writer, v1::TensorId tensor, const void* data, uint64_t bytes) {
  const auto* p = static_cast<const char*>(data);
  Message msg;
  for (uint64_t offset = 0; offset < bytes; offset += kChunkBytes) {
    const uint64_t n = std::min(kChunkBytes, bytes - offset);
    v1::TensorChunk* chunk = msg.mutable_chunk();
    chunk->set_tensor(tensor);
    chunk->set_offset(offset);
    chunk->set_data(p + offset, n);
    if (!writer->Write(msg)) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<v1::WeightsResponse> Client::RegisterWeights(const WeightsData& w) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::WeightsResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::WeightsRequest>> writer = stub_->RegisterWeights(&context, &response);
  const uint64_t cols = 3ull * w.n_heads * w.head_dim;
  const uint64_t w_bytes = cols * w.hidden * 2;
  v1::WeightsRequest msg;
  v1::WeightsHeader* h = msg.mutable_header();
  h->set_hidden(w.hidden);
  h->set_n_heads(w.n_heads);
  h->set_head_dim(w.head_dim);
  h->mutable_w_qkv()->set_inline_bytes(w_bytes);
  if (w.bias != nullptr) h->mutable_bias()->set_inline_bytes(cols * 4);
  if (w.q_norm != nullptr) h->mutable_q_norm_weight()->set_inline_bytes(static_cast<uint64_t>(w.norm_len) * 4);
  if (w.k_norm != nullptr) h->mutable_k_norm_weight()->set_inline_bytes(static_cast<uint64_t>(w.norm_len) * 4);
  bool ok = writer->Write(msg);
  ok = ok && SendChunks<grpc::ClientWriter<v1::WeightsRequest>, v1::WeightsRequest>(writer.get(), v1::TENSOR_W_QKV,
                                                                                     w.w_qkv, w_bytes);
  if (ok && w.bias != nullptr) {
    ok = SendChunks<grpc::ClientWriter<v1::WeightsRequest>, v1::WeightsRequest>(writer.get(), v1::TENSOR_BIAS, w.bias,
                                                                               cols * 4);
  }
  if (ok && w.q_norm != nullptr) {
    ok = SendChunks<grpc::ClientWriter<v1::WeightsRequest>, v1::WeightsRequest>(
        writer.get(), v1::TENSOR_Q_NORM_WEIGHT, w.q_norm, static_cast<uint64_t>(w.norm_len) * 4);
  }
  if (ok && w.k_norm != nullptr) {
    ok = SendChunks<grpc::ClientWriter<v1::WeightsRequest>, v1::WeightsRequest>(
        writer.get(), v1::TENSOR_K_NORM_WEIGHT, w.k_norm, static_cast<uint64_t>(w.norm_len) * 4);
  }
  writer->WritesDone();
  if (absl::Status s = FromGrpc(writer->Finish()); !s.ok()) return s;
  return response;
}

absl::Status Client::ReleaseWeights(const std::string& handle) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ReleaseRequest request;
  request.set_handle(handle);
  v1::ReleaseResponse response;
  return FromGrpc(stub_->ReleaseWeights(&context, request, &response));
}

absl::Status Client::ReleaseKv(const std::string& handle) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ReleaseRequest request;
  request.set_handle(handle);
  v1::ReleaseResponse response;
  return FromGrpc(stub_->ReleaseKv(&context, request, &response));
}

absl::StatusOr<v1::LayerResult> Client::AttentionLayer(v1::LayerHeader header, const LayerData& data,
                                                       absl::Duration timeout) {
  return RunLayer(Method::kAttentionLayer, std::move(header), data, timeout);
}
absl::StatusOr<v1::LayerResult> Client::Project(v1::LayerHeader header, const LayerData& data, absl::Duration timeout) {
  return RunLayer(Method::kProject, std::move(header), data, timeout);
}
absl::StatusOr<v1::LayerResult> Client::Attend(v1::LayerHeader header, const LayerData& data, absl::Duration timeout) {
  return RunLayer(Method::kAttend, std::move(header), data, timeout);
}

uint64_t ProjectedBytes(const v1::LayerHeader& header) {
  const v1::LayerShape& s = header.shape();
  const uint64_t n = static_cast<uint64_t>(std::max<int64_t>(s.n_tokens(), 0));
  const uint64_t hd = static_cast<uint64_t>(std::max(s.n_heads(), 0)) * static_cast<uint64_t>(std::max(s.head_dim(), 0));
  const v1::ProjectedQkv& p = header.projected();
  if (p.layout() == v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR && n > 0) {
    const uint64_t stride = p.row_stride() > 0 ? static_cast<uint64_t>(p.row_stride()) : hd;
    return 2 * ((n - 1) * stride + hd);
  }
  return 2 * n * hd;
}

absl::StatusOr<v1::LayerResult> Client::RunLayer(Method method, v1::LayerHeader header, const LayerData& data,
                                                 absl::Duration timeout) {
  const v1::LayerShape& shape = header.shape();
  const uint64_t x_bytes = static_cast<uint64_t>(shape.n_tokens()) * shape.hidden() * 2;
  const uint64_t pos_bytes =
      static_cast<uint64_t>(shape.n_tokens()) * header.options().rope().axis_dims_size() * 4;
  const bool x_inline = data.x != nullptr && header.x().location_case() == v1::TensorRef::LOCATION_NOT_SET;
  const bool pos_inline =
      data.positions != nullptr && header.positions().location_case() == v1::TensorRef::LOCATION_NOT_SET;
  if (x_inline) header.mutable_x()->set_inline_bytes(x_bytes);
  if (pos_inline) header.mutable_positions()->set_inline_bytes(pos_bytes);
  // Pre-projected q, k, v: the same rule per tensor.
  const bool projected = header.input_case() == v1::LayerHeader::kProjected;
  const uint64_t qkv_bytes = projected ? ProjectedBytes(header) : 0;
  const void* qkv_data[3] = {data.q, data.k, data.v};
  bool qkv_inline[3] = {false, false, false};
  if (projected) {
    v1::ProjectedQkv* p = header.mutable_projected();
    v1::TensorRef* refs[3] = {p->mutable_q(), p->mutable_k(), p->mutable_v()};
    for (int i = 0; i < 3; ++i) {
      qkv_inline[i] = qkv_data[i] != nullptr && refs[i]->location_case() == v1::TensorRef::LOCATION_NOT_SET;
      if (qkv_inline[i]) refs[i]->set_inline_bytes(qkv_bytes);
    }
  }

  grpc::ClientContext context;
  Prepare(&context, timeout);
  using Stream = grpc::ClientReaderWriter<v1::LayerRequest, v1::LayerResponse>;
  std::unique_ptr<Stream> stream;
  switch (method) {
    case Method::kAttentionLayer: stream = stub_->AttentionLayer(&context); break;
    case Method::kProject: stream = stub_->Project(&context); break;
    case Method::kAttend: stream = stub_->Attend(&context); break;
  }
  v1::LayerRequest msg;
  *msg.mutable_header() = std::move(header);
  bool ok = stream->Write(msg);
  if (ok && x_inline) ok = SendChunks<Stream, v1::LayerRequest>(stream.get(), v1::TENSOR_X, data.x, x_bytes);
  if (ok && pos_inline) {
    ok = SendChunks<Stream, v1::LayerRequest>(stream.get(), v1::TENSOR_POSITIONS, data.positions, pos_bytes);
  }
  const v1::TensorId qkv_ids[3] = {v1::TENSOR_Q, v1::TENSOR_K, v1::TENSOR_V};
  for (int i = 0; i < 3 && ok; ++i) {
    if (qkv_inline[i]) ok = SendChunks<Stream, v1::LayerRequest>(stream.get(), qkv_ids[i], qkv_data[i], qkv_bytes);
  }
  stream->WritesDone();

  v1::LayerResult result;
  bool have_result = false;
  v1::LayerResponse response;
  auto* out = static_cast<char*>(data.out);
  absl::Status local;
  while (stream->Read(&response)) {
    if (response.has_result()) {
      result = response.result();
      have_result = true;
    } else if (response.has_chunk()) {
      const v1::TensorChunk& c = response.chunk();
      if (out == nullptr || c.offset() + c.data().size() > data.out_capacity) {
        if (local.ok()) local = absl::OutOfRangeError("the output does not fit the caller's buffer");
        continue;
      }
      std::memcpy(out + c.offset(), c.data().data(), c.data().size());
    }
  }
  if (absl::Status s = FromGrpc(stream->Finish()); !s.ok()) return s;
  if (!local.ok()) return local;
  if (!have_result) return absl::InternalError("the daemon sent no result");
  return result;
}

absl::StatusOr<std::string> Client::RegisterShmRegion(const std::string& shm_name, uint64_t size_bytes) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::RegisterRegionRequest request;
  request.set_kind(v1::REGION_SHM);
  request.set_shm_name(shm_name);
  request.set_size_bytes(size_bytes);
  v1::RegisterRegionResponse response;
  if (absl::Status s = FromGrpc(stub_->RegisterRegion(&context, request, &response)); !s.ok()) return s;
  return response.region_id();
}

absl::Status Client::UnregisterRegion(const std::string& region_id) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::UnregisterRegionRequest request;
  request.set_region_id(region_id);
  v1::UnregisterRegionResponse response;
  return FromGrpc(stub_->UnregisterRegion(&context, request, &response));
}

absl::StatusOr<v1::RegionStatusResponse> Client::RegionStatus(const std::string& region_id) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::RegionStatusRequest request;
  request.set_region_id(region_id);
  v1::RegionStatusResponse response;
  if (absl::Status s = FromGrpc(stub_->RegionStatus(&context, request, &response)); !s.ok()) return s;
  return response;
}

absl::StatusOr<int> Client::KeepAlive(const std::vector<std::string>& ids) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::KeepAliveRequest request;
  for (const std::string& id : ids) request.add_ids(id);
  v1::KeepAliveResponse response;
  if (absl::Status s = FromGrpc(stub_->KeepAlive(&context, request, &response)); !s.ok()) return s;
  return response.renewed();
}

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(uint64_t size) {
  static std::atomic<int> counter{0};
  std::random_device rd;
  auto shm = std::unique_ptr<SharedMemory>(new SharedMemory());
  shm->name_ = absl::StrCat("/kvpack-", getpid(), "-", counter++, "-", rd());
  shm->size_ = size;
  const int fd = shm_open(shm->name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("shm_open ", shm->name_, ": ", std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    shm_unlink(shm->name_.c_str());
    return absl::InternalError(absl::StrCat("ftruncate: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(shm->name_.c_str());
    return absl::InternalError(absl::StrCat("mmap: ", std::strerror(errno)));
  }
  shm->data_ = static_cast<uint8_t*>(p);
  return shm;
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) munmap(data_, size_);
  shm_unlink(name_.c_str());
}

}  // namespace kvpack::client
