// The unary reactor of AttentionLayerRegions, ProjectRegions and AttendRegions: one LayerHeader in,
// one LayerResult out, for calls whose tensors are all in registered regions.
//
//   handler → admit, validate the header, plan, bind (fail fast) … submit to the Engine
//   executor → (job done) result, status
//
// The streamed call needs a read per message, a half-close and a write of the result before its
// status (four callback hand-offs on the daemon's side, the client's stream machinery on the
// other); here the request and the reply each are one message. Every check, limit, plan,
// scheduling path, metric and cancellation is LayerCallState's, the same as the stream's.
#include <utility>

#include "server/service/layer_call_state.h"
#include "server/service/service.h"
#include "server/service/upload.h"

namespace kvpack::server {
namespace {

class LayerRegionsCall final : public grpc::ServerUnaryReactor {
 public:
  LayerRegionsCall(KvpackService* service, grpc::CallbackServerContext* context, LayerMode mode,
                   const v1::LayerHeader* header, v1::LayerResult* result)
      : state_(service, context, mode, LayerTransport::kRegionsOnly), result_(result) {
    const absl::Status s = CatchAllocationFailure([&] {
      if (absl::Status s = state_.Admit(); !s.ok()) return s;
      if (absl::Status s = state_.OnHeader(*header); !s.ok()) return s;
      return state_.Submit([this](absl::Status status) {
        const absl::Status s = CatchAllocationFailure([&] {
          FinishOnce(state_.Complete(std::move(status), result_));
          return absl::OkStatus();
        });
        if (!s.ok()) FinishOnce(s);  // a no-op when the call finished before it threw
      });
    });
    if (!s.ok()) FinishOnce(s);
  }

  void OnCancel() override { state_.Cancel(); }

  void OnDone() override {
    state_.OnDone();
    delete this;
  }

 private:
  void FinishOnce(absl::Status status) {
    grpc::Status out;
    if (state_.FinishOnce(std::move(status), &out)) Finish(out);
  }

  LayerCallState state_;
  v1::LayerResult* const result_;
};

}  // namespace

grpc::ServerUnaryReactor* NewLayerRegionsCall(KvpackService* service, grpc::CallbackServerContext* context,
                                              LayerMode mode, const v1::LayerHeader* header,
                                              v1::LayerResult* result) {
  return new LayerRegionsCall(service, context, mode, header, result);
}

}  // namespace kvpack::server
