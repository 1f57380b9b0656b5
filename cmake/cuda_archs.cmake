# The CUDA archs of the build, from KVPACK_CUDA_ARCHITECTURES (top CMakeLists.txt). Included once
# CUDA is enabled; sets
#   KVPACK_CUDA_GENCODE     nvcc flags: SASS of every listed arch, PTX of the newest
#   KVPACK_CUDA_HAVE_SM90A  ON when 90a is listed (the wgmma kernel is built only then)
#   KVPACK_CUDA_ARCHS_BUILT "sm_80,…,compute_120": what the binary holds (Status reports it)
# and defines kvpack_cuda_archs(target), which gives a target's CUDA sources those flags. The flags
# are per target, not in CMAKE_CUDA_FLAGS, so that the sm_90a-only kernel (kernels/cuda) can be
# compiled for sm_90a alone.
set(KVPACK_CUDA_GENCODE "")
set(KVPACK_CUDA_HAVE_SM90A OFF)
set(kvpack_built "")
set(kvpack_newest "")
set(kvpack_newest_number 0)
if(KVPACK_CUDA_ARCHITECTURES STREQUAL "")
  message(FATAL_ERROR "KVPACK_CUDA_ARCHITECTURES is empty: list at least one arch (e.g. 90a)")
endif()
foreach(arch IN LISTS KVPACK_CUDA_ARCHITECTURES)
  if(NOT arch MATCHES "^([0-9]+)[af]?$")
    message(FATAL_ERROR "KVPACK_CUDA_ARCHITECTURES: '${arch}' is not an arch like 80, 90a or 120")
  endif()
  set(number ${CMAKE_MATCH_1})
  if(number LESS 80)
    message(FATAL_ERROR "KVPACK_CUDA_ARCHITECTURES: sm_${arch} is older than sm_80 (the kernels need cp.async and bf16 mma.sync)")
  endif()
  list(APPEND KVPACK_CUDA_GENCODE "-gencode=arch=compute_${arch}$<COMMA>code=sm_${arch}")
  list(APPEND kvpack_built "sm_${arch}")
  if(arch STREQUAL "90a")
    set(KVPACK_CUDA_HAVE_SM90A ON)
  endif()
  if(number GREATER kvpack_newest_number)
    set(kvpack_newest_number ${number})
    set(kvpack_newest ${arch})
  endif()
endforeach()
# PTX of the newest arch, for GPUs newer than the list (the driver compiles it at first load).
# An arch-specific one (90a) has no forward-compatible PTX: its plain form is used.
string(REGEX REPLACE "[af]$" "" kvpack_ptx "${kvpack_newest}")
list(APPEND KVPACK_CUDA_GENCODE "-gencode=arch=compute_${kvpack_ptx}$<COMMA>code=compute_${kvpack_ptx}")
list(APPEND kvpack_built "compute_${kvpack_ptx}")
string(REPLACE ";" "," KVPACK_CUDA_ARCHS_BUILT "${kvpack_built}")
message(STATUS "kvpack: CUDA archs ${KVPACK_CUDA_ARCHS_BUILT}")

function(kvpack_cuda_archs target)
  foreach(flag IN LISTS KVPACK_CUDA_GENCODE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${flag}>)
  endforeach()
endfunction()
