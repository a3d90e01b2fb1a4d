// PYBIND11_MODULE(_C): build information plus the per-area bindings.
#include "bindings/bindings.h"

#ifndef SKYRL_TX_TORCH_VERSION
#error "SKYRL_TX_TORCH_VERSION must be defined by the build"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "skyrl_tx C++ core (libtorch): decoder models with multi-slot LoRA";
  m.def("build_info", [] {
    py::dict info;
    info["torch_version"] = SKYRL_TX_TORCH_VERSION;
#ifdef SKYRL_TX_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
#ifdef SKYRL_TX_WITH_NCCL
    info["nccl"] = true;
#else
    info["nccl"] = false;
#endif
    info["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
    return info;
  });
  skyrl_tx::bindings::bind_errors(m);
  skyrl_tx::bindings::bind_models(m);
  skyrl_tx::bindings::bind_training(m);
  skyrl_tx::bindings::bind_sampling(m);
  skyrl_tx::bindings::bind_backend(m);
  skyrl_tx::bindings::bind_dist(m);
}
