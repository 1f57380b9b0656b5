// A Backend that fails its device work when a FaultInjector says so (site kDeviceCall): the failure
// of a CUDA or cuBLASLt call inside ProjectKv, AttendLayer, CopyToPool or CopyFromPool as the CUDA
// backend reports it — INTERNAL with the call's text, and sticky (Healthy() turns false, the daemon
// reports NOT_SERVING). Everything else is forwarded. The Engine wraps its backend in one when
// EngineOptions::faults is set (tests only), so the service's error paths for device failures run
// on machines without a GPU.
//
// Thread safety: as the wrapped backend.
#pragma once

#include <memory>

#include "server/backends/backend.h"
#include "server/core/fault_injector.h"

namespace kvpack::server {

// REQUIRES: faults outlives the returned backend.
std::unique_ptr<Backend> WithDeviceFaults(std::unique_ptr<Backend> backend, FaultInjector* faults);

}  // namespace kvpack::server
