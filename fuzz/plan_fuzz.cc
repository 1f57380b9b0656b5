// Fuzz target: the Plan RPC's work (PlanCall: conversion, limits, validation, planner, PlanResult)
// on a v1::PlanRequest (wire bytes, or 't' + text format: ParseInput), with the daemon's default
// limits and a CPU-backend engine.
//
// Beyond "no crash, no UB, no hang", an OK answer must be self-consistent:
//   * one RangePlan per requested range, their tokens summing to N, each format among the range's
//     allowed ones (INT4 when none were listed), downgraded exactly when it is not the first;
//   * peak = kv + workspace + io, and a plan that fits has peak ≤ capacity;
//   * chunks in (0, N] (unless it does not fit, which still names a floor plan).
// Every refusal must be INVALID_ARGUMENT, NOT_FOUND (an unknown weights handle) or
// RESOURCE_EXHAUSTED / FAILED_PRECONDITION — never INTERNAL or UNKNOWN.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "fuzz/fuzz_input.h"
#include "server/backends/cpu_backend.h"
#include "server/service/convert.h"
#include "server/service/service.h"

namespace kvpack::server {
namespace {

constexpr uint64_t kBudgetBytes = 80ull << 30;  // an H200's worth: large plans must fit or fail cleanly

[[noreturn]] void Fail(const std::string& what, const v1::PlanRequest& request) {
  std::fprintf(stderr, "plan_fuzz: %s\nrequest: %s\n", what.c_str(), request.ShortDebugString().c_str());
  std::abort();
}

void CheckPlan(const v1::PlanRequest& request, const v1::PlanResponse& response) {
  const v1::LayerHeader& h = request.header();
  const v1::PlanResult& plan = response.plan();
  if (plan.ranges_size() != h.ranges_size()) Fail("range count differs", request);
  int64_t tokens = 0;
  for (int i = 0; i < plan.ranges_size(); ++i) {
    const v1::RangePlan& r = plan.ranges(i);
    const v1::TokenRange& in = h.ranges(i);
    if (r.tokens() != in.end() - in.begin()) Fail("range tokens differ from end - begin", request);
    tokens += r.tokens();
    int index = -1;
    for (int j = 0; j < in.allowed_formats_size(); ++j) {
      if (in.allowed_formats(j) == r.format()) {
        index = j;
        break;
      }
    }
    if (in.allowed_formats_size() == 0) index = r.format() == v1::FORMAT_INT4 ? 0 : -1;
    if (index < 0) Fail("range " + std::to_string(i) + " planned in a format it does not allow", request);
    if (r.downgraded() != (index > 0)) Fail("range " + std::to_string(i) + ": downgraded flag is wrong", request);
  }
  if (tokens != h.shape().n_tokens()) Fail("ranges do not cover N", request);
  if (plan.predicted_peak_bytes() != plan.kv_bytes() + plan.workspace_bytes() + plan.io_bytes()) {
    Fail("peak != kv + workspace + io", request);
  }
  if (response.fits() && plan.predicted_peak_bytes() > plan.capacity_bytes()) Fail("fits above capacity", request);
  if (!response.fits() && response.reason().empty()) Fail("does not fit, without a reason", request);
  const int64_t n = h.shape().n_tokens();
  if (plan.projection_chunk() < 1 || plan.projection_chunk() > n || plan.query_chunk() < 1 ||
      plan.query_chunk() > n) {
    Fail("chunk sizes outside (0, N]", request);
  }
}

}  // namespace


}  // namespace kvpack::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpack::server;
  static SystemClock clock;
  static auto* engine = [] {
    EngineOptions eo;
    eo.budget_bytes = kBudgetBytes;
    return new Engine(eo, MakeCpuBackend(1), &clock);
  }();
  kvpack::v1::PlanRequest request;
  if (!ParseInput(data, size, &request)) return 0;
  kvpack::v1::PlanResponse response;
  const absl::Status status = PlanCall(*engine, "default", ServiceLimits(), request, &response);
  switch (status.code()) {
    case absl::StatusCode::kOk: CheckPlan(request, response); break;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kFailedPrecondition:
      if (status.message().empty()) Fail("a refusal without a message", request);
      break;
    default: Fail("unexpected status " + status.ToString(), request);
  }
  return 0;
}
