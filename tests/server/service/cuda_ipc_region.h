// Test helper of the GPU daemon tests: registers device memory with kvpackd as a CUDA IPC region.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "client/client.h"

namespace kvpack::testing {

// Registers `bytes` of the cudaMalloc allocation `allocation` (device 0) through `client`; returns the
// region id (empty, with a test failure recorded, when the daemon refuses).
inline std::string RegisterCudaIpcRegion(client::Client& client, void* allocation, uint64_t bytes) {
  cudaIpcMemHandle_t handle;
  EXPECT_EQ(cudaIpcGetMemHandle(&handle, allocation), cudaSuccess);
  v1::RegisterRegionRequest req;
  req.set_kind(v1::REGION_CUDA_IPC);
  req.set_cuda_ipc_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  req.set_device(0);
  req.set_size_bytes(bytes);
  v1::RegisterRegionResponse resp;
  grpc::ClientContext ctx;
  client.Prepare(&ctx);
  const grpc::Status st = client.stub()->RegisterRegion(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp.region_id();
}

}  // namespace kvpack::testing
