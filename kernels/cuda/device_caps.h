// The GPU's and the binary's side of the attention kernel choice (kernels/kernel_choice.h):
// DeviceCaps read from cudaGetDeviceProperties once per device and kept for the process, and the
// archs this library was compiled for (KVPACK_CUDA_ARCHITECTURES).
#pragma once

#include "kernels/error.h"
#include "kernels/kernel_choice.h"

namespace kvpack::cuda {

// The caps of `device` (read on the first call for that device; later calls return the same).
// Thread-safe. Errors: kInternal when the CUDA runtime cannot read the device.
Error DeviceCapsOf(int device, DeviceCaps* caps);
// DeviceCapsOf(the calling thread's current device).
Error CurrentDeviceCaps(DeviceCaps* caps);
// Whether this binary holds the sm_90a wgmma kernel (90a was in KVPACK_CUDA_ARCHITECTURES).
bool BuiltWithSm90a();
// The code this binary holds, "sm_80,sm_86,…,compute_120" (cmake/cuda_archs.cmake).
const char* CudaArchsBuilt();

}  // namespace kvpack::cuda
