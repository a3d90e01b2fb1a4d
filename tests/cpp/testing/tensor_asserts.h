// EXPECT_TENSOR_CLOSE / EXPECT_TENSOR_EQ: tensor comparisons that print shapes and the max difference.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>

namespace skyrl_tx::testing {

inline ::testing::AssertionResult tensors_close(const at::Tensor& actual, const at::Tensor& expected, double rtol,
                                                double atol) {
  if (actual.sizes() != expected.sizes()) {
    std::ostringstream out;
    out << "shape mismatch: actual " << actual.sizes() << " vs expected " << expected.sizes();
    return ::testing::AssertionFailure() << out.str();
  }
  at::Tensor a = actual.detach().to(at::kCPU, at::kDouble), e = expected.detach().to(at::kCPU, at::kDouble);
  if (at::allclose(a, e, rtol, atol)) return ::testing::AssertionSuccess();
  std::ostringstream out;
  out << "tensors differ (shape " << actual.sizes() << "): max |diff| = " << (a - e).abs().max().item<double>()
      << " (rtol " << rtol << ", atol " << atol << ")";
  return ::testing::AssertionFailure() << out.str();
}

}  // namespace skyrl_tx::testing

#define EXPECT_TENSOR_CLOSE(actual, expected, rtol, atol) \
  EXPECT_TRUE(::skyrl_tx::testing::tensors_close((actual), (expected), (rtol), (atol)))
#define EXPECT_TENSOR_EQ(actual, expected) EXPECT_TRUE(::skyrl_tx::testing::tensors_close((actual), (expected), 0, 0))
