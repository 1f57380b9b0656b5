// The streaming reactor of AttentionLayer, Project and Attend.
//
//   client → header, chunks of inline tensors (in order), half-close
//   daemon → (validate the header, plan, fail fast) … (upload complete) submit to the Engine …
//            (job done on an executor thread) result, chunks of the inline output, status
//
// Exactly one Finish: every path ends in FinishOnce. The reactor lives until OnDone; the job never
// outlives it because Finish waits for the job (the job's done callback is what finishes a call
// that reached the Engine).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/service/convert.h"
#include "server/service/service.h"
#include "server/service/upload.h"

namespace kvpack::server {
namespace {

constexpr uint64_t kChunkBytes = 2ull << 20;  // output chunk; well below gRPC's 4 MiB message limit

const char* MethodName(LayerMode mode) {
  switch (mode) {
    case LayerMode::kFull: return "AttentionLayer";
    case LayerMode::kProject: return "Project";
    case LayerMode::kAttend: return "Attend";
  }
  return "AttentionLayer";
}

// One input tensor as the header declared it.
struct Input {
  const char* field = "";
  uint64_t size = 0;        // expected bytes
  bool is_inline = false;
  uint8_t* data = nullptr;  // inline buffer or region slice
  uint64_t received = 0;    // inline bytes so far
  uint64_t align = 4;       // required alignment of a region slice
};

class LayerCall final : public grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse> {
 public:
  LayerCall(KvpackService* service, grpc::CallbackServerContext* context, LayerMode mode)
      : service_(service), context_(context), mode_(mode), method_(MethodName(mode)) {
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
          in_, have_header_, [this](const v1::LayerHeader& h) { return OnHeader(h); },
          [this](const v1::TensorChunk& c) { return OnChunk(c); });
    });
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      FinishOnce(absl::CancelledError("the client stopped reading the output"));
      return;
    }
    // Each output chunk is a 2 MiB copy into the message: an allocation on a callback thread.
    const absl::Status s = CatchAllocationFailure([this] {
      WriteNext();
      return absl::OkStatus();
    });
    if (!s.ok()) FinishOnce(s);
  }

  void OnCancel() override {
    std::shared_ptr<LayerJob> job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      job = job_;
    }
    if (job) job->cancelled = true;
    if (job && submitted_) service_->engine().Cancel(job);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status OnHeader(const v1::LayerHeader& header) {
    have_header_ = true;
    header_start_ = absl::Now();
    Engine& engine = service_->engine();
    auto job = std::make_shared<LayerJob>();
    job->mode = mode_;
    job->method = method_;
    job->tenant = tenant_;
    job->priority = header.priority();
    job->keep_kv = header.keep_kv() || mode_ == LayerMode::kProject;
    if (context_->deadline() != std::chrono::system_clock::time_point::max()) {
      job->deadline = absl::FromChrono(context_->deadline());
    }
    if (absl::Status s = BindWaitEvent(header, job.get()); !s.ok()) return s;

    // Pre-projected q, k, v take the place of x and the weights (AttentionLayer only).
    projected_ = header.input_case() == v1::LayerHeader::kProjected;
    if (projected_ && mode_ != LayerMode::kFull) {
      return absl::InvalidArgumentError(absl::StrCat("header.projected: only AttentionLayer takes projected q, k, v; ",
                                                     method_, " needs x and a weights handle"));
    }
    absl::StatusOr<LayerRequest> request;
    if (projected_) {
      request = LayerRequestFromProto(header, /*has_bias=*/false, /*qk_norm_weight_len=*/0);
      if (!request.ok()) return request.status();
      if (absl::Status s = CheckLimits(request->shape, service_->limits()); !s.ok()) return s;
    } else {
      absl::StatusOr<std::shared_ptr<WeightsEntry>> weights =
          engine.registry().GetWeights(tenant_, header.weights_handle(), "header.weights_handle");
      if (!weights.ok()) return weights.status();
      job->weights = *weights;
      const WeightsEntry& w = **weights;
      request = LayerRequestFromProto(header, w.has_bias, w.norm_len);
      if (!request.ok()) return request.status();
      if (absl::Status s = CheckLimits(request->shape, service_->limits()); !s.ok()) return s;
      const LayerShape& shape = request->shape;
      if (shape.hidden != w.hidden || shape.n_heads != w.n_heads || shape.head_dim != w.head_dim) {
        return absl::InvalidArgumentError(absl::StrCat(
            "header.shape (hidden ", shape.hidden, ", n_heads ", shape.n_heads, ", head_dim ", shape.head_dim,
            ") does not match the weights (hidden ", w.hidden, ", n_heads ", w.n_heads, ", head_dim ", w.head_dim, ")"));
      }
      if (request->qk_norm.enabled && w.norm_len == 0) {
        return absl::InvalidArgumentError("header.options.qk_norm.enabled: the weights have no q/k norm weights");
      }
    }
    const LayerShape& shape = request->shape;
    if (job->keep_kv) {  // fail fast; the engine checks again when it registers the entry
      if (absl::Status s = engine.registry().CheckHandleRoom(tenant_); !s.ok()) return s;
    }

    if (mode_ == LayerMode::kAttend) {
      absl::StatusOr<std::shared_ptr<KvEntry>> kv = engine.registry().GetKv(tenant_, header.kv_handle(), "header.kv_handle");
      if (!kv.ok()) return kv.status();
      job->kv_in = *kv;
      if (absl::Status s = MatchKv(**kv, *request, *job->weights); !s.ok()) return s;
      // The entry's transforms are the ones its pages were written with.
      request->transforms = (*kv)->config.transforms;
      request->rope = (*kv)->config.rope;
      request->qk_norm = (*kv)->config.qk_norm;
    } else if (!header.kv_handle().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("header.kv_handle: only Attend takes a K/V handle, not ", method_));
    }

    // Tensors in CUDA IPC regions are device memory: the plan reserves no staging copies for them.
    const v1::OutputSpec& output = header.output();
    request->resident.x = InDeviceRegion(header.x());
    request->resident.positions = InDeviceRegion(header.positions());
    if (projected_) {
      request->resident.q = InDeviceRegion(header.projected().q());
      request->resident.k = InDeviceRegion(header.projected().k());
      request->resident.v = InDeviceRegion(header.projected().v());
    }
    request->resident.out = mode_ == LayerMode::kProject ||
                            (output.mode() == v1::OUTPUT_REGION && InDeviceRegion(output.region().region_id())) ||
                            (output.mode() == v1::OUTPUT_IN_PLACE && request->resident.x);
    job->resident = request->resident;

    const absl::Time plan_start = absl::Now();
    if (absl::Status s = engine.policies().Resolve(&*request); !s.ok()) return s;
    absl::StatusOr<LayerPlan> plan = engine.Plan(tenant_, *request, job->kv_in.get());
    plan_seconds_ = absl::ToDoubleSeconds(absl::Now() - plan_start);
    if (!plan.ok()) return plan.status();
    if (!plan->fits) return absl::ResourceExhaustedError(plan->reason);
    job->plan = std::move(*plan);

    // Inputs.
    if (projected_) {
      const uint64_t span = 2ull * static_cast<uint64_t>(request->projected.SpanElements(shape));
      const v1::ProjectedQkv& p = header.projected();
      const v1::TensorRef* refs[3] = {&p.q(), &p.k(), &p.v()};
      const char* fields[3] = {"header.projected.q", "header.projected.k", "header.projected.v"};
      for (int i = 0; i < 3; ++i) {
        qkv_[i].field = fields[i];
        qkv_[i].size = span;
        qkv_[i].align = 16;  // the GPU epilogue loads a lane's channels as one 8-byte word
        if (absl::Status s = Bind(*refs[i], &qkv_[i], job.get(), /*required=*/true); !s.ok()) return s;
      }
    } else {
      x_.field = "header.x";
      x_.size = static_cast<uint64_t>(shape.n_tokens) * shape.hidden * 2;
      if (absl::Status s = Bind(header.x(), &x_, job.get(), /*required=*/true); !s.ok()) return s;
    }
    const bool rope = request->rope.layout != RopeLayout::kNone;
    positions_.field = "header.positions";
    positions_.size = rope ? static_cast<uint64_t>(shape.n_tokens) * request->rope.n_axes * 4 : 0;
    if (!rope && header.positions().location_case() != v1::TensorRef::LOCATION_NOT_SET) {
      return absl::InvalidArgumentError("header.positions: given without RoPE (options.rope.layout is LAYOUT_NONE)");
    }
    if (rope) {
      if (absl::Status s = Bind(header.positions(), &positions_, job.get(), /*required=*/true); !s.ok()) return s;
    }
    uint64_t inline_total = 0;
    for (const Input* input : Inputs()) inline_total += input->is_inline ? input->size : 0;
    if (inline_total > service_->limits().max_inline_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("inline tensors of ", inline_total,
                                                       " bytes exceed this daemon's limit of ",
                                                       service_->limits().max_inline_bytes, " per request; use a region"));
    }
    // Host bytes of this call outside the pool: inline inputs and an inline output, claimed from the
    // daemon's in-flight budget before any is allocated; the lease goes with the job.
    const uint64_t out_size = static_cast<uint64_t>(shape.n_tokens) * shape.HeadCols() * 2;
    const v1::OutputMode out_mode = header.output().mode();
    const bool out_is_inline = mode_ != LayerMode::kProject && out_mode == v1::OUTPUT_INLINE;
    if (const uint64_t host = inline_total + (out_is_inline ? out_size : 0); host > 0) {
      absl::StatusOr<InlineBudget::Lease> lease = engine.inline_budget().Acquire(host);
      if (!lease.ok()) return lease.status();
      job->inline_lease = std::move(*lease);
    }
    if (x_.is_inline) {
      if (absl::Status s = AllocateHost(x_.size, x_.field, &job->x_buf); !s.ok()) return s;
      x_.data = job->x_buf.get();
    }
    if (positions_.is_inline) {
      if (absl::Status s = AllocateHost(positions_.size, positions_.field, &job->positions_buf); !s.ok()) return s;
      positions_.data = job->positions_buf.get();
    }
    for (int i = 0; i < 3; ++i) {
      if (!qkv_[i].is_inline) continue;
      if (absl::Status s = AllocateHost(qkv_[i].size, qkv_[i].field, &job->qkv_buf[i]); !s.ok()) return s;
      qkv_[i].data = job->qkv_buf[i].get();
    }
    job->tensors.x = reinterpret_cast<const uint16_t*>(x_.data);
    job->tensors.q = reinterpret_cast<const uint16_t*>(qkv_[0].data);
    job->tensors.k = reinterpret_cast<const uint16_t*>(qkv_[1].data);
    job->tensors.v = reinterpret_cast<const uint16_t*>(qkv_[2].data);
    job->tensors.positions = rope ? reinterpret_cast<const float*>(positions_.data) : nullptr;

    // Output.
    job->out_bytes = out_size;
    if (mode_ == LayerMode::kProject) {
      if (out_mode != v1::OUTPUT_INLINE && out_mode != v1::OUTPUT_NONE) {
        return absl::InvalidArgumentError("header.output.mode: Project writes no output (use OUTPUT_NONE)");
      }
    } else {
      switch (out_mode) {
        case v1::OUTPUT_INLINE:
          if (absl::Status s = AllocateHost(out_size, "header.output", &job->out_buf); !s.ok()) return s;
          job->tensors.out = reinterpret_cast<uint16_t*>(job->out_buf.get());
          out_inline_ = job->out_buf.get();
          break;
        case v1::OUTPUT_IN_PLACE:
          job->tensors.out = reinterpret_cast<uint16_t*>(x_.data);
          if (x_.is_inline) out_inline_ = x_.data;
          break;
        case v1::OUTPUT_REGION: {
          const v1::RegionSlice& slice = header.output().region();
          if (slice.size_bytes() != out_size) {
            return absl::InvalidArgumentError(absl::StrCat("header.output.region.size_bytes = ", slice.size_bytes(),
                                                           ", expected N * n_heads * head_dim * 2 = ", out_size));
          }
          absl::StatusOr<RegionUse> use = engine.registry().UseRegion(tenant_, slice.region_id(), "header.output.region");
          if (!use.ok()) return use.status();
          absl::StatusOr<uint8_t*> p = use->get()->Slice(slice.offset(), out_size, "header.output.region");
          if (!p.ok()) return p.status();
          job->tensors.out = reinterpret_cast<uint16_t*>(*p);
          job->regions.push_back(std::move(*use));
          break;
        }
        case v1::OUTPUT_NONE:
          return absl::InvalidArgumentError(absl::StrCat("header.output.mode: ", method_, " writes an output"));
        default:
          return absl::InvalidArgumentError(absl::StrCat("header.output.mode = ", out_mode, " is not known"));
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    return absl::OkStatus();
  }

  // A host buffer of `bytes`, or RESOURCE_EXHAUSTED naming `field` when the allocation fails (a
  // failed new[] would otherwise throw through gRPC's callback machinery and the call never end).
  static absl::Status AllocateHost(uint64_t bytes, const char* field, std::unique_ptr<uint8_t[]>* out) {
    out->reset(bytes <= SIZE_MAX ? new (std::nothrow) uint8_t[bytes] : nullptr);
    if (*out == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat(field, ": the daemon cannot allocate ", bytes, " bytes of host memory for it; use a region"));
    }
    return absl::OkStatus();
  }

  // Checks that an Attend request describes the tokens its K/V entry was projected from.
  absl::Status MatchKv(const KvEntry& kv, const LayerRequest& request, const WeightsEntry& w) {
    if (kv.weights_id != w.id) {
      return absl::InvalidArgumentError("header.kv_handle: the entry was projected with other weights");
    }
    const LayerShape& a = kv.config.shape;
    if (a.n_tokens != request.shape.n_tokens || a.n_heads != request.shape.n_heads ||
        a.head_dim != request.shape.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("header.shape: the K/V entry has ", a.n_tokens, " tokens, ",
                                                     a.n_heads, " heads of ", a.head_dim, "; the request differs"));
    }
    if (kv.config.ranges.size() != request.ranges.size()) {
      return absl::InvalidArgumentError(absl::StrCat("header.ranges: the K/V entry has ", kv.config.ranges.size(), " ranges"));
    }
    for (size_t i = 0; i < request.ranges.size(); ++i) {
      const TokenRange& k = kv.config.ranges[i];
      const RangeRequest& r = request.ranges[i];
      if (k.begin != r.begin || k.end != r.end || k.seq_id != r.seq_id) {
        return absl::InvalidArgumentError(absl::StrCat("header.ranges[", i, "]: differs from the K/V entry's [", k.begin,
                                                       ", ", k.end, ") seq ", k.seq_id));
      }
    }
    return absl::OkStatus();
  }

  // header.cuda_wait_event: the caller's event the job waits for (Engine::WaitForCaller).
  absl::Status BindWaitEvent(const v1::LayerHeader& header, LayerJob* job) {
    constexpr size_t kIpcEventHandleBytes = 64;  // sizeof(cudaIpcEventHandle_t)
    const std::string& event = header.cuda_wait_event();
    if (event.empty()) return absl::OkStatus();
    if (event.size() != kIpcEventHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("header.cuda_wait_event: ", event.size(),
                                                     " bytes, expected the 64 of a cudaIpcEventHandle_t"));
    }
    Backend& backend = service_->engine().backend();
    if (!backend.TakesIpcEvents()) return backend.WaitIpcEvent(event, absl::InfinitePast());  // says why not
    job->wait_event = event;
    return absl::OkStatus();
  }

  // Whether `region_id` names one of this tenant's CUDA IPC regions (device memory, used in place).
  // An unknown id is answered later, where the tensor is bound, with the field named.
  bool InDeviceRegion(const std::string& region_id) const {
    absl::StatusOr<RegionUse> use = service_->engine().registry().UseRegion(tenant_, region_id, "");
    return use.ok() && use->get()->kind() == RegionKind::kCudaIpc;
  }
  bool InDeviceRegion(const v1::TensorRef& ref) const {
    return ref.location_case() == v1::TensorRef::kRegion && InDeviceRegion(ref.region().region_id());
  }

  absl::Status Bind(const v1::TensorRef& ref, Input* input, LayerJob* job, bool required) {
    switch (ref.location_case()) {
      case v1::TensorRef::LOCATION_NOT_SET:
        return required ? absl::InvalidArgumentError(absl::StrCat(input->field, ": required")) : absl::OkStatus();
      case v1::TensorRef::kInlineBytes:
        if (ref.inline_bytes() != input->size) {
          return absl::InvalidArgumentError(absl::StrCat(input->field, ".inline_bytes = ", ref.inline_bytes(),
                                                         ", expected ", input->size));
        }
        input->is_inline = true;
        return absl::OkStatus();
      case v1::TensorRef::kRegion: {
        const v1::RegionSlice& slice = ref.region();
        const std::string field = absl::StrCat(input->field, ".region");
        if (slice.size_bytes() != input->size) {
          return absl::InvalidArgumentError(absl::StrCat(field, ".size_bytes = ", slice.size_bytes(), ", expected ",
                                                         input->size));
        }
        absl::StatusOr<RegionUse> use = service_->engine().registry().UseRegion(tenant_, slice.region_id(), field);
        if (!use.ok()) return use.status();
        absl::StatusOr<uint8_t*> p = use->get()->Slice(slice.offset(), input->size, field);
        if (!p.ok()) return p.status();
        if (reinterpret_cast<uintptr_t>(*p) % input->align != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".offset = ", slice.offset(), " is not ", input->align, "-byte aligned"));
        }
        input->data = *p;
        job->regions.push_back(std::move(*use));
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(input->field, ": unknown location"));
  }

  absl::Status OnChunk(const v1::TensorChunk& chunk) {
    if (++chunks_ > service_->limits().max_chunks_per_call) return TooManyChunks(service_->limits());
    Input* input = nullptr;
    switch (chunk.tensor()) {
      case v1::TENSOR_X: input = &x_; break;
      case v1::TENSOR_POSITIONS: input = &positions_; break;
      case v1::TENSOR_Q: input = &qkv_[0]; break;
      case v1::TENSOR_K: input = &qkv_[1]; break;
      case v1::TENSOR_V: input = &qkv_[2]; break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("chunk.tensor = ", chunk.tensor(), ": ", method_,
                                                       " takes TENSOR_X (or TENSOR_Q, _K, _V), TENSOR_POSITIONS"));
    }
    if (input->size == 0 && !input->is_inline) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.tensor: ", TensorName(chunk.tensor()),
                                                     " is not an input of this header"));
    }
    if (!input->is_inline) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.tensor: ", input->field, " was not declared inline"));
    }
    if (chunk.offset() != input->received) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.offset = ", chunk.offset(), " for ", input->field,
                                                     ": chunks must arrive in order; expected ", input->received));
    }
    const uint64_t n = chunk.data().size();
    if (n > input->size - input->received) {
      return absl::InvalidArgumentError(absl::StrCat("chunk.data: ", input->field, " is ", input->size,
                                                     " bytes; this chunk ends at ", chunk.offset() + n));
    }
    std::memcpy(input->data + input->received, chunk.data().data(), n);
    input->received += n;
    service_->CountInline(n, 0);
    return absl::OkStatus();
  }

  void OnUploadComplete() {
    if (context_->IsCancelled()) {
      FinishOnce(absl::CancelledError("the client cancelled the call"));
      return;
    }
    if (!have_header_) {
      FinishOnce(absl::InvalidArgumentError("header: the stream ended before a header"));
      return;
    }
    for (const Input* input : Inputs()) {
      if (input->is_inline && input->received != input->size) {
        FinishOnce(absl::InvalidArgumentError(absl::StrCat(input->field, ": received ", input->received, " of ",
                                                           input->size, " bytes before the stream closed")));
        return;
      }
    }
    upload_seconds_ = absl::ToDoubleSeconds(absl::Now() - header_start_) - plan_seconds_;
    std::shared_ptr<LayerJob> job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      job = job_;
      if (cancelled_) job->cancelled = true;
    }
    job->done = [this](absl::Status status) {
      const absl::Status s = CatchAllocationFailure([&] {
        OnJobDone(std::move(status));
        return absl::OkStatus();
      });
      if (!s.ok()) FinishOnce(s);  // a no-op when OnJobDone finished the call before it threw
    };
    submitted_ = true;
    service_->engine().Submit(job);
  }

  // On an executor thread (or the scheduler's pump on reject).
  void OnJobDone(absl::Status status) {
    // A shared-memory object truncated while the job read or wrote it was swapped for zero pages
    // (shm_guard.h): what the job computed from or into it is void, a kept K/V entry included.
    for (const RegionUse& use : job_->regions) {
      if (absl::Status s = use.get()->Intact(); !s.ok() && status.ok()) status = s;
    }
    if (!status.ok() && !job_->kv_handle.empty()) {
      (void)service_->engine().registry().ReleaseKv(tenant_, job_->kv_handle);
    }
    // Handles and regions are let go before the client hears back, so a release it sends next frees
    // their memory at once.
    job_->weights.reset();
    job_->kv_in.reset();
    job_->regions.clear();
    if (!status.ok()) {
      FinishOnce(status);
      return;
    }
    v1::LayerResult* result = out_.mutable_result();
    if (job_->estimate.present) {  // the run's own estimate replaces the one the plan was given
      for (size_t i = 0; i < job_->plan.ranges.size(); ++i) {
        RangePlan& r = job_->plan.ranges[i];
        r.estimated_rel_error = job_->estimate.rel_error[static_cast<int>(r.format)];
      }
      EstimateToProto(job_->estimate, result->mutable_estimated_rel_error());
    }
    PlanToProto(job_->plan, result->mutable_plan());
    result->mutable_plan()->set_mma(MmaPathName(service_->engine().backend().ResolvedMma(job_->plan.config)));
    result->set_kv_handle(job_->kv_handle);
    result->set_peak_bytes(job_->peak_bytes);
    result->set_routed_fraction(job_->sparse_report.RoutedFraction());
    v1::StageSeconds* sec = result->mutable_seconds();
    sec->set_queue(job_->queue_seconds);
    sec->set_project(job_->project_seconds);
    sec->set_attend(job_->attend_seconds);
    sec->set_transfer(upload_seconds_ + job_->transfer_seconds);
    sec->set_plan(plan_seconds_);
    sec->set_allocate(job_->allocate_seconds);
    sec->set_turn_wait(job_->turn_wait_seconds);
    sec->set_release(job_->release_seconds);
    sec->set_total(absl::ToDoubleSeconds(absl::Now() - header_start_));
    if (out_inline_ != nullptr) result->set_output_bytes(job_->out_bytes);
    download_start_ = absl::Now();
    StartWrite(&out_);
  }

  void WriteNext() {
    if (out_inline_ == nullptr || sent_ >= job_->out_bytes) {
      service_->engine().metrics().ObserveStage(
          Stage::kTransfer, upload_seconds_ + absl::ToDoubleSeconds(absl::Now() - download_start_));
      FinishOnce(absl::OkStatus());
      return;
    }
    const uint64_t n = std::min(kChunkBytes, job_->out_bytes - sent_);
    out_.Clear();
    v1::TensorChunk* chunk = out_.mutable_chunk();
    chunk->set_tensor(v1::TENSOR_OUTPUT);
    chunk->set_offset(sent_);
    chunk->set_data(out_inline_ + sent_, n);
    sent_ += n;
    service_->CountInline(0, n);
    StartWrite(&out_);
  }

  void FinishOnce(absl::Status status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
    }
    // A client whose deadline passes cancels the call (RST_STREAM) a little before the daemon's copy
    // of the deadline (computed from grpc-timeout on arrival) passes; name that cause.
    constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(100);
    if (status.code() == absl::StatusCode::kCancelled &&
        context_->deadline() != std::chrono::system_clock::time_point::max() &&
        absl::Now() >= absl::FromChrono(context_->deadline()) - kDeadlineSlack) {
      status = absl::DeadlineExceededError(status.message());
    }
    Finish(service_->Finished(method_, status));
  }

  KvpackService* const service_;
  grpc::CallbackServerContext* const context_;
  const LayerMode mode_;
  const char* const method_;
  std::string tenant_;
  v1::LayerRequest in_;
  v1::LayerResponse out_;
  bool have_header_ = false;
  std::array<const Input*, 5> Inputs() const { return {&x_, &positions_, &qkv_[0], &qkv_[1], &qkv_[2]}; }
  static const char* TensorName(v1::TensorId id) {
    switch (id) {
      case v1::TENSOR_X: return "header.x";
      case v1::TENSOR_Q: return "header.projected.q";
      case v1::TENSOR_K: return "header.projected.k";
      case v1::TENSOR_V: return "header.projected.v";
      default: return "header.positions";
    }
  }

  Input x_, positions_;
  Input qkv_[3];  // header.projected q, k, v
  bool projected_ = false;
  uint8_t* out_inline_ = nullptr;
  uint64_t sent_ = 0;
  int64_t chunks_ = 0;
  absl::Time header_start_, download_start_;
  double upload_seconds_ = 0, plan_seconds_ = 0;
  std::atomic<bool> submitted_{false};
  std::mutex mu_;
  std::shared_ptr<LayerJob> job_;
  bool cancelled_ = false;
  bool finished_ = false;
};

}  // namespace

grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* NewLayerCall(KvpackService* service,
                                                                          grpc::CallbackServerContext* context,
                                                                          LayerMode mode) {
  return new LayerCall(service, context, mode);
}

}  // namespace kvpack::server
