# Decides whether the CUDA path is compiled: by toolkit + CUDA torch, never by GPU presence.
# Exports SKYRL_TX_CUDA_ENABLED (BOOL).
set(SKYRL_TX_CUDA_ENABLED OFF)
if(NOT SKYRL_TX_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER AND NOT SKYRL_TX_TORCH_CUDA_VERSION STREQUAL "")
    set(SKYRL_TX_CUDA_ENABLED ON)
  elseif(SKYRL_TX_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "skyrl_tx: SKYRL_TX_WITH_CUDA=ON but nvcc='${CMAKE_CUDA_COMPILER}' and "
      "torch CUDA='${SKYRL_TX_TORCH_CUDA_VERSION}'; install the CUDA toolkit and a CUDA build of torch")
  endif()
endif()

if(SKYRL_TX_CUDA_ENABLED)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80-real 90)   # A100, H100/H200 (+PTX for newer)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  string(REGEX MATCH "^[0-9]+" _nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
  string(REGEX MATCH "^[0-9]+" _torch_cuda_major "${SKYRL_TX_TORCH_CUDA_VERSION}")
  if(NOT _nvcc_major STREQUAL _torch_cuda_major)
    message(WARNING "skyrl_tx: nvcc ${CMAKE_CUDA_COMPILER_VERSION} vs torch CUDA ${SKYRL_TX_TORCH_CUDA_VERSION}: "
      "major versions differ; kernels may fail to load")
  endif()
endif()
message(STATUS "skyrl_tx: CUDA path ${SKYRL_TX_CUDA_ENABLED}")
