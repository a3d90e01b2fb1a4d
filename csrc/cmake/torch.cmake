# Finds torch via the Python interpreter that builds us (never a second torch from build isolation).
# Exports: SKYRL_TX_TORCH_VERSION, SKYRL_TX_TORCH_CUDA_VERSION, SKYRL_TX_CXX11_ABI, TORCH_PYTHON_LIBRARY.
find_package(Python 3.10 REQUIRED COMPONENTS Interpreter Development.Module)

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(torch.version.cuda or ''); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  RESULT_VARIABLE _torch_rc OUTPUT_VARIABLE _torch_out ERROR_VARIABLE _torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR
    "skyrl_tx: cannot import torch with ${Python_EXECUTABLE}:\n${_torch_err}\n"
    "Fix: install torch first (pip install torch==2.11.0), then build with "
    "`pip install --no-build-isolation -e .`")
endif()
string(REPLACE "\n" ";" _torch_out "${_torch_out}")
list(GET _torch_out 0 _torch_prefix)
list(GET _torch_out 1 SKYRL_TX_TORCH_VERSION)
list(LENGTH _torch_out _n)
set(SKYRL_TX_TORCH_CUDA_VERSION "")
if(_n EQUAL 4)
  list(GET _torch_out 2 SKYRL_TX_TORCH_CUDA_VERSION)
  list(GET _torch_out 3 SKYRL_TX_CXX11_ABI)
else()
  list(GET _torch_out 2 SKYRL_TX_CXX11_ABI)
endif()

# FORCE: an isolated build env from a previous configure may have moved; always follow this interpreter.
set(Torch_DIR "${_torch_prefix}/Torch" CACHE PATH "Torch CMake config dir" FORCE)
# TorchConfig probes for CUDA itself when torch is a CUDA build; our own option (cuda.cmake) stays
# authoritative, so keep its probe quiet on machines without a toolkit.
# Without a GPU, torch's CMake would otherwise guess "all" architectures, including ones nvcc 13 dropped.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()
find_package(Torch REQUIRED)
message(STATUS "skyrl_tx: torch ${SKYRL_TX_TORCH_VERSION} (cuda '${SKYRL_TX_TORCH_CUDA_VERSION}', cxx11 abi ${SKYRL_TX_CXX11_ABI})")

# pybind11 Tensor casters live in libtorch_python (pytorch/pytorch#38122).
get_filename_component(_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
find_library(TORCH_PYTHON_LIBRARY torch_python PATHS "${_torch_lib_dir}" REQUIRED NO_DEFAULT_PATH)
