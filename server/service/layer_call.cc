// The streaming reactor of AttentionLayer, Project and Attend.
//
//   client → header, chunks of inline tensors (in order), half-close
//   daemon → (validate the header, plan, fail fast) … (upload complete) submit to the Engine …
//            (job done on an executor thread) result, chunks of the inline output, status
//
// Everything but moving messages is LayerCallState's (shared with the unary *Regions calls).
// Exactly one Finish: every path ends in FinishOnce. The reactor lives until OnDone; the job never
// outlives it because Finish waits for the job (the job's done callback is what finishes a call
// that reached the Engine).
#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "server/service/layer_call_state.h"
#include "server/service/service.h"
#include "server/service/upload.h"

namespace kvpack::server {
namespace {

constexpr uint64_t kChunkBytes = 2ull << 20;  // output chunk; well below gRPC's 4 MiB message limit

class LayerCall final : public grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse> {
 public:
  LayerCall(KvpackService* service, grpc::CallbackServerContext* context, LayerMode mode)
      : service_(service), state_(service, context, mode, LayerTransport::kStream) {
    if (absl::Status s = state_.Admit(); !s.ok()) {
      FinishOnce(s);
      return;
    }
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      OnUploadComplete();
      return;
    }
    const absl::Status s = CatchAllocationFailure([this] {
      return DispatchUpload(
          in_, state_.have_header(), [this](const v1::LayerHeader& h) { return state_.OnHeader(h); },
          [this](const v1::TensorChunk& c) { return state_.OnChunk(c); });
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

  void OnCancel() override { state_.Cancel(); }

  void OnDone() override {
    state_.OnDone();
    delete this;
  }

 private:
  void OnUploadComplete() {
    const absl::Status s = state_.Submit([this](absl::Status status) {
      const absl::Status s = CatchAllocationFailure([&] {
        OnJobDone(std::move(status));
        return absl::OkStatus();
      });
      if (!s.ok()) FinishOnce(s);  // a no-op when OnJobDone finished the call before it threw
    });
    if (!s.ok()) FinishOnce(s);
  }

  // On an executor thread (or the scheduler's pump on reject).
  void OnJobDone(absl::Status status) {
    status = state_.Complete(std::move(status), out_.mutable_result());
    if (!status.ok()) {
      FinishOnce(status);
      return;
    }
    download_start_ = absl::Now();
    StartWrite(&out_);
  }

  void WriteNext() {
    const uint64_t total = state_.output_bytes();
    if (sent_ >= total) {
      service_->engine().metrics().ObserveStage(
          Stage::kTransfer, state_.upload_seconds() + absl::ToDoubleSeconds(absl::Now() - download_start_));
      FinishOnce(absl::OkStatus());
      return;
    }
    const uint64_t n = std::min(kChunkBytes, total - sent_);
    out_.Clear();
    v1::TensorChunk* chunk = out_.mutable_chunk();
    chunk->set_tensor(v1::TENSOR_OUTPUT);
    chunk->set_offset(sent_);
    chunk->set_data(state_.inline_output() + sent_, n);
    sent_ += n;
    service_->CountInline(0, n);
    StartWrite(&out_);
  }

  void FinishOnce(absl::Status status) {
    grpc::Status out;
    if (state_.FinishOnce(std::move(status), &out)) Finish(out);
  }

  KvpackService* const service_;
  LayerCallState state_;
  v1::LayerRequest in_;
  v1::LayerResponse out_;
  uint64_t sent_ = 0;
  absl::Time download_start_;
};

}  // namespace

grpc::ServerBidiReactor<v1::LayerRequest, v1::LayerResponse>* NewLayerCall(KvpackService* service,
                                                                          grpc::CallbackServerContext* context,
                                                                          LayerMode mode) {
  return new LayerCall(service, context, mode);
}

}  // namespace kvpack::server
