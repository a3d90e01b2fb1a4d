# Finds NCCL for weight sync (CUDA builds only): torch's nvidia-nccl wheel first, then the system.
# Exports SKYRL_TX_NCCL_ENABLED, NCCL_INCLUDE_DIR, NCCL_LIBRARY.
set(SKYRL_TX_NCCL_ENABLED OFF)
if(SKYRL_TX_CUDA_ENABLED AND NOT SKYRL_TX_WITH_NCCL STREQUAL "OFF")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util as u, os; s = u.find_spec('nvidia.nccl'); print(os.path.dirname(s.origin) if s and s.origin else (list(s.submodule_search_locations)[0] if s else ''))"
    OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  set(_nccl_hints "${_nccl_wheel}" "${CUDAToolkit_LIBRARY_ROOT}" "${CUDAToolkit_TARGET_DIR}" /usr/local/cuda /usr)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(SKYRL_TX_NCCL_ENABLED ON)
  elseif(SKYRL_TX_WITH_NCCL STREQUAL "ON")
    message(FATAL_ERROR "skyrl_tx: NCCL not found (searched: ${_nccl_hints})")
  endif()
endif()
message(STATUS "skyrl_tx: NCCL ${SKYRL_TX_NCCL_ENABLED} ${NCCL_LIBRARY}")
