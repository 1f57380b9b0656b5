// The client-streaming reactor of RegisterWeights: header, then chunks of the inline tensors, which
// are written straight into the weights' pool block (state "weights", the tenant's bytes).
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/service/service.h"
#include "server/service/status_map.h"
#include "server/service/upload.h"

namespace kvpack::server {
namespace {

struct Part {
  const char* field = "";
  v1::TensorId id = v1::TENSOR_UNSPECIFIED;
  uint64_t offset = 0;  // inside the pool block
  uint64_t size = 0;
  bool is_inline = false;
  uint64_t received = 0;
};

class WeightsCall final : public grpc::ServerReadReactor<v1::WeightsRequest> {
 public:
  WeightsCall(KvpackService* service, grpc::CallbackServerContext* context, v1::WeightsResponse* response)
      : service_(service), context_(context), response_(response) {
    absl::StatusOr<std::string> tenant = service_->Admit(*context_);
    if (!tenant.ok()) {
      FinishOnce(tenant.status());
      return;
    }
    tenant_ = *tenant;
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      OnUploadComplete();
      return;
    }
    const absl::Status s = CatchAllocationFailure([this] {
      return DispatchUpload(
          in_, entry_ != nullptr, [this](const v1::WeightsHeader& h) { return OnHeader(h); },
          [this](const v1::TensorChunk& c) { return OnChunk(c); });
    });
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    StartRead(&in_);
  }

  void OnDone() override {
    if (uncounted_) service_->RecordShortUpload("RegisterWeights", *uncounted_, *context_);
    delete this;
  }

 private:
  absl::Status OnHeader(const v1::WeightsHeader& h) {
    const ServiceLimits& limits = service_->limits();
    if (h.hidden() <= 0 || h.hidden() > limits.max_hidden) {
      return absl::InvalidArgumentError(absl::StrCat("header.hidden = ", h.hidden(), " must be in [1, ", limits.max_hidden, "]"));
    }
    if (h.n_heads() <= 0 || h.n_heads() > limits.max_heads) {
      return absl::InvalidArgumentError(absl::StrCat("header.n_heads = ", h.n_heads(), " must be in [1, ", limits.max_heads, "]"));
    }
    const int d = h.head_dim();
    if (d < kMinHeadDimCpu || d > kMaxHeadDimCpu || (d & (d - 1)) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("header.head_dim = ", d, " must be a power of two in [16, 256]"));
    }
    auto entry = std::make_shared<WeightsEntry>();
    entry->id = Registry::NewId("w-");
    entry->tenant = tenant_;
    entry->hidden = h.hidden();
    entry->n_heads = h.n_heads();
    entry->head_dim = d;
    entry->has_bias = h.bias().location_case() != v1::TensorRef::LOCATION_NOT_SET;
    const bool has_q = h.q_norm_weight().location_case() != v1::TensorRef::LOCATION_NOT_SET;
    const bool has_k = h.k_norm_weight().location_case() != v1::TensorRef::LOCATION_NOT_SET;
    if (has_q != has_k) {
      return absl::InvalidArgumentError("header.q_norm_weight, header.k_norm_weight: give both or neither");
    }
    if (has_q) {
      const uint64_t q = SizeOf(h.q_norm_weight());
      const uint64_t hd = static_cast<uint64_t>(h.n_heads()) * d;
      if (q != static_cast<uint64_t>(d) * 4 && q != hd * 4) {
        return absl::InvalidArgumentError(absl::StrCat("header.q_norm_weight: ", q, " bytes; expected head_dim or n_heads * head_dim float32 (",
                                                       d * 4, " or ", hd * 4, ")"));
      }
      entry->norm_len = static_cast<int>(q / 4);
    }
    parts_[0] = Part{"header.w_qkv", v1::TENSOR_W_QKV, 0, entry->w_bytes()};
    parts_[1] = Part{"header.bias", v1::TENSOR_BIAS, entry->bias_offset(), entry->bias_bytes()};
    parts_[2] = Part{"header.q_norm_weight", v1::TENSOR_Q_NORM_WEIGHT, entry->q_norm_offset(), entry->norm_bytes()};
    parts_[3] = Part{"header.k_norm_weight", v1::TENSOR_K_NORM_WEIGHT, entry->k_norm_offset(), entry->norm_bytes()};
    const v1::TensorRef* refs[4] = {&h.w_qkv(), &h.bias(), &h.q_norm_weight(), &h.k_norm_weight()};
    if (refs[0]->location_case() == v1::TensorRef::LOCATION_NOT_SET) return absl::InvalidArgumentError("header.w_qkv: required");

    Engine& engine = service_->engine();
    if (absl::Status s = engine.registry().CheckHandleRoom(tenant_); !s.ok()) return s;
    if (absl::Status s = engine.CheckQuota(tenant_, entry->total_bytes()); !s.ok()) return s;
    absl::StatusOr<Pool::Lease> lease = engine.pool().Allocate({entry->total_bytes(), PoolState::kWeights, tenant_, {}});
    if (!lease.ok()) return lease.status();
    entry->lease = std::move(*lease);
    for (int i = 0; i < 4; ++i) {
      Part& p = parts_[i];
      const v1::TensorRef& ref = *refs[i];
      if (ref.location_case() == v1::TensorRef::LOCATION_NOT_SET) continue;
      if (ref.location_case() == v1::TensorRef::kInlineBytes) {
        if (ref.inline_bytes() != p.size) {
          return absl::InvalidArgumentError(absl::StrCat(p.field, ".inline_bytes = ", ref.inline_bytes(), ", expected ", p.size));
        }
        p.is_inline = true;
        continue;
      }
      const v1::RegionSlice& slice = ref.region();
      const std::string field = absl::StrCat(p.field, ".region");
      if (slice.size_bytes() != p.size) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".size_bytes = ", slice.size_bytes(), ", expected ", p.size));
      }
      absl::StatusOr<RegionUse> use = engine.registry().UseRegion(tenant_, slice.region_id(), field);
      if (!use.ok()) return use.status();
      absl::StatusOr<uint8_t*> src = use->get()->Slice(slice.offset(), p.size, field);
      if (!src.ok()) return src.status();
      if (absl::Status s = engine.backend().CopyToPool(entry->lease.data() + p.offset, *src, p.size); !s.ok()) return s;
      if (absl::Status s = use->get()->Intact(); !s.ok()) return s;  // truncated during the copy
      p.received = p.size;
    }
    entry_ = std::move(entry);
    return absl::OkStatus();
  }

  static uint64_t SizeOf(const v1::TensorRef& ref) {
    return ref.location_case() == v1::TensorRef::kInlineBytes ? ref.inline_bytes() : ref.region().size_bytes();
  }

  absl::Status OnChunk(const v1::TensorChunk& chunk) {
    if (++chunks_ > service_->limits().max_chunks_per_call) return TooManyChunks(service_->limits());
    Part* part = nullptr;
    for (Part& p : parts_) {
      if (p.id == chunk.tensor()) part = &p;
    }
    if (part == nullptr || !part->is_inline) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.tensor = ", chunk.tensor(), ": not an inline tensor of this header"));
    }
    if (chunk.offset() != part->received) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.offset = ", chunk.offset(), " for ", part->field,
                                                     ": chunks must arrive in order; expected ", part->received));
    }
    const uint64_t n = chunk.data().size();
    if (n > part->size - part->received) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.data: ", part->field, " is ", part->size,
                                                     " bytes; this chunk ends at ", chunk.offset() + n));
    }
    absl::Status s = service_->engine().backend().CopyToPool(entry_->lease.data() + part->offset + part->received,
                                                             chunk.data().data(), n);
    part->received += n;
    service_->CountInline(n, 0);
    return s;
  }

  void OnUploadComplete() {
    if (context_->IsCancelled()) {
      FinishOnce(absl::CancelledError("the client cancelled the call"));
      return;
    }
    if (!entry_) {
      short_upload_ = true;
      FinishOnce(absl::InvalidArgumentError("header: the stream ended before a header"));
      return;
    }
    for (const Part& p : parts_) {
      if (p.is_inline && p.received != p.size) {
        short_upload_ = true;
        FinishOnce(absl::InvalidArgumentError(absl::StrCat(p.field, ": received ", p.received, " of ", p.size,
                                                           " bytes before the stream closed")));
        return;
      }
    }
    response_->set_handle(entry_->id);
    response_->set_pool_bytes(entry_->lease.bytes());
    response_->set_lease_seconds(absl::ToDoubleSeconds(service_->engine().registry().lease()));
    const absl::Status added = service_->engine().registry().AddWeights(entry_);
    if (added.ok()) entry_.reset();  // the registry's now (leases reap entries nobody else holds)
    FinishOnce(added);
  }

  void FinishOnce(const absl::Status& status) {
    if (finished_) return;
    finished_ = true;
    if (!status.ok()) entry_.reset();  // frees the pool block at once
    if (short_upload_) {  // counted in OnDone (KvpackService::RecordShortUpload)
      const grpc::Status out = ToGrpcStatus(status);
      uncounted_ = out.error_code();
      Finish(out);
      return;
    }
    Finish(service_->Finished("RegisterWeights", status));
  }

  KvpackService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::WeightsResponse* const response_;
  std::string tenant_;
  v1::WeightsRequest in_;
  std::shared_ptr<WeightsEntry> entry_;
  Part parts_[4];
  int64_t chunks_ = 0;
  bool finished_ = false;
  bool short_upload_ = false;                  // the stream ended before every inline byte came
  std::optional<grpc::StatusCode> uncounted_;  // counted in OnDone
};

}  // namespace

grpc::ServerReadReactor<v1::WeightsRequest>* NewWeightsCall(KvpackService* service,
                                                           grpc::CallbackServerContext* context,
                                                           v1::WeightsResponse* response) {
  return new WeightsCall(service, context, response);
}

}  // namespace kvpack::server
