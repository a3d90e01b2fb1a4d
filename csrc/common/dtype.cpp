// Parsing and printing of the compute dtypes and devices the backend accepts.
#include "common/dtype.h"

#include "common/errors.h"

namespace skyrl_tx {

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32" || name == "fp32") return at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  throw InvalidArgument(str_cat("dtype: unsupported value '", name, "'; use 'float32' or 'bfloat16'"));
}

std::string dtype_name(at::ScalarType dtype) {
  if (dtype == at::kFloat) return "float32";
  if (dtype == at::kBFloat16) return "bfloat16";
  return c10::toString(dtype);
}

at::Device parse_device(const std::string& name) {
  at::Device device(at::kCPU);
  try {
    device = at::Device(name);
  } catch (const c10::Error&) {
    throw InvalidArgument(str_cat("device: cannot parse '", name, "'; use 'cpu', 'cuda' or 'cuda:N'"));
  }
  SKYRL_TX_CHECK(device.is_cpu() || device.is_cuda(), InvalidArgument, "device: '", name,
                 "' is not supported; use 'cpu', 'cuda' or 'cuda:N'");
  if (device.is_cuda()) {
    SKYRL_TX_CHECK(at::hasCUDA(), InvalidArgument, "device: '", name,
                   "' requested but no CUDA device is available; use 'cpu'");
  }
  return device;
}

std::string shape_str(const at::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace skyrl_tx
