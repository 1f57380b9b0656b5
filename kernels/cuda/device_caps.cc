#include "kernels/cuda/device_caps.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "kernels/cuda/cuda_status.h"

#ifndef KVPACK_CUDA_ARCHS_BUILT
#error "KVPACK_CUDA_ARCHS_BUILT comes from kernels/cuda/CMakeLists.txt"
#endif

namespace kvpack::cuda {

bool BuiltWithSm90a() {
#if defined(KVPACK_HAVE_SM90A)
  return true;
#else
  return false;
#endif
}

const char* CudaArchsBuilt() { return KVPACK_CUDA_ARCHS_BUILT; }

Error DeviceCapsOf(int device, DeviceCaps* caps) {
  // cudaGetDeviceProperties takes milliseconds; LaunchAttention asks for every query chunk.
  static std::mutex mu;
  static std::map<int, DeviceCaps>* known = new std::map<int, DeviceCaps>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = known->find(device);
  if (it == known->end()) {
    cudaDeviceProp prop{};
    KVPACK_CUDA_RETURN(cudaGetDeviceProperties(&prop, device));
    DeviceCaps c;
    c.cc_major = prop.major, c.cc_minor = prop.minor;
    c.smem_per_block_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
    c.smem_per_sm = static_cast<int>(prop.sharedMemPerMultiprocessor);
    c.smem_reserved_per_block = static_cast<int>(prop.reservedSharedMemPerBlock);
    c.sm_count = prop.multiProcessorCount;
    c.has_sm90a_code = BuiltWithSm90a();
    it = known->emplace(device, c).first;
  }
  *caps = it->second;
  return Error::Ok();
}

Error CurrentDeviceCaps(DeviceCaps* caps) {
  int device = 0;
  KVPACK_CUDA_RETURN(cudaGetDevice(&device));
  return DeviceCapsOf(device, caps);
}

}  // namespace kvpack::cuda
