// Tests the CUDA fused RMSNorm (ops::fused_rmsnorm) against the ATen formula, fp32 and bf16, several shapes.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <vector>

#include "common/errors.h"
#include "models/layers.h"
#include "ops/fused_rmsnorm.h"
#include "testing/tensor_asserts.h"

namespace skyrl_tx::ops {
namespace {

// transformers' RMSNorm: normalise in float32, round to the input dtype, then scale by the weight.
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor normed = (x32 * at::rsqrt(x32.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
  return w * normed;
}

class FusedRmsNormTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(FusedRmsNormTest, MatchesAtenFormula) {
  const at::ScalarType dtype = GetParam();
  const bool bf16 = dtype == at::kBFloat16;
  c10::NoGradGuard no_grad;
  at::manual_seed(0);
  const std::vector<std::vector<int64_t>> shapes = {{1, 8}, {3, 128}, {17, 1000}, {2, 5, 4096}, {64, 257}, {4, 8, 128}};
  for (const auto& shape : shapes) {
    at::Tensor x = (at::randn(shape, at::TensorOptions().device(at::kCUDA)) * 3.0).to(dtype);
    at::Tensor w = (1.0 + 0.1 * at::randn({shape.back()}, at::TensorOptions().device(at::kCUDA))).to(dtype);
    ASSERT_TRUE(can_use_fused_rmsnorm(x));
    at::Tensor y = fused_rmsnorm(x, w, 1e-6);
    ASSERT_EQ(y.sizes(), x.sizes());
    EXPECT_EQ(y.scalar_type(), dtype);
    EXPECT_EQ(y.device(), x.device());
    at::Tensor expected = reference(x, w, 1e-6);
    // bf16: one rounding step of the normalised value may differ (reduction order), so allow ~2 ulp.
    EXPECT_TENSOR_CLOSE(y, expected, bf16 ? 1.6e-2 : 1e-5, bf16 ? 1e-2 : 1e-5) << "shape " << at::IntArrayRef(shape);
  }
}

TEST_P(FusedRmsNormTest, RmsNormModuleUsesKernelAndAgreesWithCpu) {
  const at::ScalarType dtype = GetParam();
  const bool bf16 = dtype == at::kBFloat16;
  c10::NoGradGuard no_grad;
  at::manual_seed(1);
  at::Tensor x = at::randn({6, 96}).to(dtype), w = (1.0 + 0.1 * at::randn({96})).to(dtype);
  at::Tensor cpu = models::RmsNorm(w, 1e-5).forward(x);
  at::Tensor gpu = models::RmsNorm(w.cuda(), 1e-5).forward(x.cuda());
  EXPECT_TRUE(gpu.is_cuda());
  EXPECT_TENSOR_CLOSE(gpu.cpu(), cpu, bf16 ? 1.6e-2 : 1e-5, bf16 ? 1e-2 : 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedRmsNormTest, ::testing::Values(at::kFloat, at::kBFloat16),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return info.param == at::kFloat ? "fp32" : "bf16";
                         });

TEST(FusedRmsNorm, EligibilityAndErrors) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::Tensor x = at::randn({4, 32}, at::TensorOptions().device(at::kCUDA));
  {
    c10::NoGradGuard no_grad;
    EXPECT_TRUE(can_use_fused_rmsnorm(x));
    EXPECT_FALSE(can_use_fused_rmsnorm(x.cpu()));
    EXPECT_FALSE(can_use_fused_rmsnorm(x.t()));                   // not contiguous
    EXPECT_FALSE(can_use_fused_rmsnorm(x.to(at::kHalf)));         // unsupported dtype
    EXPECT_THROW(fused_rmsnorm(x, at::ones({32}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16)), 1e-6), InvalidArgument);
    EXPECT_THROW(fused_rmsnorm(x, at::ones({32}), 1e-6), InvalidArgument);  // weight on CPU
  }
  EXPECT_FALSE(can_use_fused_rmsnorm(x));  // autograd on: the ATen path is used
}

}  // namespace
}  // namespace skyrl_tx::ops
