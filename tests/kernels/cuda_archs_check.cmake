# ctest cuda_archs_test: the CUDA archs of KVPACK_CUDA_ARCHITECTURES are in libkvpack_cuda.a, as
# `cuobjdump --list-elf` / `--list-ptx` list them: every portable kernel source (row_epilogue,
# attention, attention_sm80_mma) has SASS of every listed arch and PTX of the newest; the wgmma
# kernel (attention_sm90) has sm_90a SASS and nothing else. Skips (SKIPPED: …) without cuobjdump.
# Run as: cmake -DCUOBJDUMP=… -DLIBRARY=… -DARCHS=80,86,… -P cuda_archs_check.cmake
string(REPLACE "," ";" ARCHS "${ARCHS}")
cmake_policy(SET CMP0057 NEW)  # if(IN_LIST)
if(NOT CUOBJDUMP OR NOT EXISTS "${CUOBJDUMP}")
  message("SKIPPED: cuobjdump not found (scripts/setup.sh installs it from PyPI: nvidia-cuda-cuobjdump)")
  return()
endif()
foreach(what elf ptx)
  execute_process(COMMAND "${CUOBJDUMP}" --list-${what} "${LIBRARY}" OUTPUT_VARIABLE listing_${what}
                  ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "cuobjdump --list-${what} ${LIBRARY} failed (${rc}): ${err}")
  endif()
endforeach()

set(newest "")
set(newest_number 0)
set(missing "")
foreach(arch IN LISTS ARCHS)
  string(REGEX MATCH "^[0-9]+" number "${arch}")
  if(number GREATER newest_number)
    set(newest_number ${number})
  endif()
  foreach(source row_epilogue attention attention_sm80_mma)
    if(NOT listing_elf MATCHES "ELF file +[0-9]+: ${source}\\.sm_${arch}\\.cubin")
      list(APPEND missing "${source}.sm_${arch}.cubin")
    endif()
  endforeach()
endforeach()
foreach(source row_epilogue attention attention_sm80_mma)
  if(NOT listing_ptx MATCHES "PTX file +[0-9]+: ${source}\\.sm_${newest_number}\\.ptx")
    list(APPEND missing "${source}.sm_${newest_number}.ptx")
  endif()
endforeach()

# The wgmma kernel: sm_90a alone, and only where 90a is listed.
string(REGEX MATCHALL "attention_sm90\\.[a-z_0-9]+\\.cubin" sm90_cubins "${listing_elf}")
if("90a" IN_LIST ARCHS)
  if(NOT sm90_cubins STREQUAL "attention_sm90.sm_90a.cubin")
    message(FATAL_ERROR "attention_sm90 must hold sm_90a alone; cuobjdump lists: ${sm90_cubins}")
  endif()
elseif(sm90_cubins)
  message(FATAL_ERROR "attention_sm90 is built although 90a is not in ${ARCHS}: ${sm90_cubins}")
endif()

if(missing)
  message(FATAL_ERROR "missing from ${LIBRARY}: ${missing}\n--list-elf:\n${listing_elf}\n--list-ptx:\n${listing_ptx}")
endif()
list(LENGTH ARCHS n)
message("OK: ${n} archs (${ARCHS}) in every kernel source, PTX sm_${newest_number}; attention_sm90: ${sm90_cubins}")
