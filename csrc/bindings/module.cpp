// PYBIND11_MODULE(_C): build information plus the per-area bindings.
#include "backend/fault_injection.h"
#include "bindings/bindings.h"
#include "ops/cpu_vector_kernels.h"

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
#ifdef SKYRL_TX_TESTING
    info["testing"] = true;
#else
    info["testing"] = false;
#endif
    return info;
  });
  // The benchmark's A/B of the fused CPU ops (ops/cpu_vector_kernels.h): on or off from the next step; returns
  // whether they now run (false on a CPU without AVX2 and FMA).
  m.def("_set_fused_cpu_ops", &skyrl_tx::ops::set_fused_cpu_ops, py::arg("on"));
#ifdef SKYRL_TX_TESTING
  // Test builds only (SKYRL_TX_BUILD_TESTS=ON): a one-shot failure of training micro-batch k (< 0 disarms);
  // returns what was armed before (-1 once the failure fired).
  m.def("_testing_fail_micro_batch", &skyrl_tx::backend::fault_injection::fail_micro_batch, py::arg("k"));
#endif
  skyrl_tx::bindings::bind_errors(m);
  skyrl_tx::bindings::bind_models(m);
  skyrl_tx::bindings::bind_custom_loss(m);  // before training: TrainRequest.custom_loss names CustomLoss
  skyrl_tx::bindings::bind_training(m);
  skyrl_tx::bindings::bind_sampling(m);
  skyrl_tx::bindings::bind_dist(m);  // before the backend: Backend.attach_collectives names Collectives
  skyrl_tx::bindings::bind_backend(m);
}
