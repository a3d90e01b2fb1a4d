// Parsing and printing of the compute dtypes and devices the backend accepts.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace skyrl_tx {

/// "float32"/"fp32" or "bfloat16"/"bf16" → ScalarType; throws InvalidArgument otherwise.
at::ScalarType parse_dtype(const std::string& name);
std::string dtype_name(at::ScalarType dtype);
/// "cpu", "cuda" or "cuda:N" → Device; throws InvalidArgument (also when no CUDA device is present).
at::Device parse_device(const std::string& name);
/// "[4, 128]"-style rendering for error messages.
std::string shape_str(const at::Tensor& t);

}  // namespace skyrl_tx
