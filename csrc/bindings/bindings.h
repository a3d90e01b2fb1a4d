// Declarations of the per-area binding functions that module.cpp calls.
#pragma once

// Not <torch/extension.h>: that adds torch/all.h (the C++ frontend: nn, optim, data, serialize, jit), which no
// binding uses, to what every binding compiles. This is pybind11 with torch's casters (Tensor, Device, dtype).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

namespace skyrl_tx::bindings {

void bind_errors(pybind11::module_& m);
void bind_models(pybind11::module_& m);
void bind_backend(pybind11::module_& m);
void bind_training(pybind11::module_& m);
void bind_custom_loss(pybind11::module_& m);
void bind_sampling(pybind11::module_& m);
void bind_dist(pybind11::module_& m);

}  // namespace skyrl_tx::bindings
