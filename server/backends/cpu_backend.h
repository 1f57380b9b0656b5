// The CPU backend: the reference kernels (kernels/cpu/layer.h) on host memory. It is what the daemon
// runs on machines without a GPU, and what every GPU-free test exercises.
#pragma once

#include <memory>

#include "server/backends/backend.h"

namespace kvpack::server {

std::unique_ptr<Backend> MakeCpuBackend(int n_threads);

}  // namespace kvpack::server
