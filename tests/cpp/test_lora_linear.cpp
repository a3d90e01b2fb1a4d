// Tests lora::LoraLinear: base equivalence of fresh slots, per-segment LoRA math, ranks, disable, init and gradients.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "common/errors.h"
#include "lora/lora_linear.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::lora {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

constexpr int64_t kIn = 12, kOut = 10, kSlots = 4, kMaxRank = 4;

class LoraLinearTest : public ::testing::Test {
 protected:
  LoraLinearTest() : gen_(make_gen(1234)) {
    weight_ = randn({kOut, kIn}, gen_);
    bias_ = randn({kOut}, gen_);
    x_ = randn({9, kIn}, gen_);
  }

  // Reference: x W^T + b + scaling * (x A^T) B^T.
  at::Tensor expected(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, double scaling) const {
    at::Tensor y = at::matmul(x, weight_.t()) + bias_;
    if (a.defined()) y = y + scaling * at::matmul(at::matmul(x, a.t()), b.t());
    return y;
  }

  at::Generator gen_;
  at::Tensor weight_, bias_, x_;
};

TEST_F(LoraLinearTest, FreshSlotEqualsBaseBitForBit) {
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  EXPECT_FALSE(lin.slot_enabled(1));
  lin.enable_slot(1, kMaxRank, 2.0, make_gen(7));
  EXPECT_TRUE(lin.slot_enabled(1));
  EXPECT_EQ(lin.slot_rank(1), kMaxRank);
  EXPECT_GT(lin.lora_a(1).abs().max().item<float>(), 0.0f);  // A is random ...
  EXPECT_EQ(lin.lora_b(1).abs().max().item<float>(), 0.0f);  // ... B is zero
  at::Tensor base = at::linear(x_, weight_, bias_);
  at::Tensor y = lin.forward(x_, AdapterSegments::uniform(1, x_.size(0)));
  EXPECT_TRUE(at::equal(y, base));
  EXPECT_TENSOR_CLOSE(base, expected(x_, at::Tensor(), at::Tensor(), 0.0), 1e-5, 1e-5);
}

// The row-dense path (what CUDA-graph decode uses) computes what the per-segment path computes, for rows in
// any order, slots of different ranks, a disabled slot and the base slot.
TEST_F(LoraLinearTest, RowDenseEqualsSegments) {
  c10::NoGradGuard no_grad;
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  lin.enable_slot(1, kMaxRank, 0.5, make_gen(1));
  lin.enable_slot(2, 2, 3.0, make_gen(2));
  lin.enable_slot(3, 3, 1.5, make_gen(3));
  lin.set_factors(1, randn({kMaxRank, kIn}, gen_), randn({kOut, kMaxRank}, gen_));
  lin.set_factors(2, randn({2, kIn}, gen_), randn({kOut, 2}, gen_));
  lin.set_factors(3, randn({3, kIn}, gen_), randn({kOut, 3}, gen_));
  lin.disable_slot(3);  // disabled after use: its columns must contribute nothing
  const std::vector<int64_t> slot_of_row = {2, 0, 1, 1, 3, 2, 0, 1, 2};
  at::Tensor columns = slot_columns(at::tensor(slot_of_row, at::kLong), kSlots, kMaxRank);  // [9, S * R]
  at::Tensor dense = lin.forward(x_, AdapterSegments::row_dense(columns));
  at::Tensor segmented = lin.forward(x_, AdapterSegments::from_rows(slot_of_row, 1));
  EXPECT_TENSOR_CLOSE(dense, segmented, 1e-5, 1e-5);
  EXPECT_TENSOR_CLOSE(dense.select(0, 4), at::linear(x_.select(0, 4), weight_, bias_), 1e-5, 1e-5);  // slot 3 off
}

// The row-dense path reads inference copies of the factors (B pre-scaled; copies in a bf16 model); every way
// factors and scalings change (an optimizer's in-place update of a slot view, set_factors, a new tenant of a
// slot with another rank and scaling, a disabled slot) must reach them before the next forward.
TEST_F(LoraLinearTest, RowDenseFollowsFactorAndScalingUpdates) {
  c10::NoGradGuard no_grad;
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const double tolerance = dtype == at::kFloat ? 1e-5 : 3e-2;
    LoraLinear lin(weight_.to(dtype), bias_.to(dtype), kSlots, kMaxRank);
    const at::Tensor x = x_.to(dtype);
    const std::vector<int64_t> slot_of_row = {2, 0, 1, 1, 3, 2, 0, 1, 2};
    const AdapterSegments dense = AdapterSegments::row_dense(
        slot_columns(at::tensor(slot_of_row, at::kLong), kSlots, kMaxRank));  // [9, S * R]
    const AdapterSegments segmented = AdapterSegments::from_rows(slot_of_row, 1);
    auto check = [&](const char* after) {
      SCOPED_TRACE(after);
      EXPECT_TENSOR_CLOSE(lin.forward(x, dense).to(at::kFloat), lin.forward(x, segmented).to(at::kFloat), tolerance,
                          tolerance);
    };
    lin.enable_slot(1, kMaxRank, 0.5, make_gen(1));
    lin.enable_slot(2, 2, 3.0, make_gen(2));
    lin.set_factors(1, randn({kMaxRank, kIn}, gen_), randn({kOut, kMaxRank}, gen_));
    lin.set_factors(2, randn({2, kIn}, gen_), randn({kOut, 2}, gen_));
    check("set_factors");
    lin.lora_a(1).add_(randn({kMaxRank, kIn}, gen_));  // what AdamW does to a trained slot's views
    lin.lora_b(2).mul_(-2.0);
    check("in-place updates of slot views");
    lin.disable_slot(2);
    lin.load_slot(2, 3, 7.0, randn({3, kIn}, gen_), randn({kOut, 3}, gen_));  // another rank and scaling
    lin.enable_slot(3, 1, 2.0, make_gen(3));
    lin.set_factors(3, randn({1, kIn}, gen_), randn({kOut, 1}, gen_));
    check("a new tenant in a slot, a newly enabled slot");
    lin.disable_slot(1);
    check("a disabled slot");
    EXPECT_TENSOR_CLOSE(lin.forward(x, dense).select(0, 2).to(at::kFloat),
                        at::linear(x.select(0, 2), lin.weight(), lin.bias()).to(at::kFloat), tolerance, tolerance);
  }
}

// Training through the row-dense batch path (many adapters, one matmul per direction) gives the per-segment
// path's output, input gradient and per-slot factor gradients.
TEST_F(LoraLinearTest, RowDenseBatchTrainingEqualsSegments) {
  const std::vector<int64_t> slot_of_row = {1, 1, 2, 0, 3, 3, 3, 2, 1};
  struct Result {
    at::Tensor y, grad_x;
    std::vector<at::Tensor> grad_a, grad_b;
  };
  auto run = [&](RowDenseBatches policy) {
    LoraLinear::set_row_dense_batches(policy);
    LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
    at::Generator gen = make_gen(5);
    {
      c10::NoGradGuard no_grad;
      const int64_t ranks[] = {0, kMaxRank, 2, 3};
      const double scalings[] = {0, 0.5, 3.0, 4.0 / 3.0};
      for (int64_t slot = 1; slot < kSlots; ++slot) {
        lin.enable_slot(slot, ranks[slot], scalings[slot], gen);
        lin.set_factors(slot, randn({ranks[slot], kIn}, gen), randn({kOut, ranks[slot]}, gen));
      }
    }
    at::Tensor x = x_.clone().requires_grad_(true);
    Result r;
    r.y = lin.forward(x, AdapterSegments::from_rows(slot_of_row, 1));
    (r.y * at::linspace(-1, 1, r.y.numel()).view_as(r.y)).sum().backward();
    r.grad_x = x.grad();
    for (int64_t slot = 1; slot < kSlots; ++slot) {
      r.grad_a.push_back(lin.lora_a_grad(slot).clone());
      r.grad_b.push_back(lin.lora_b_grad(slot).clone());
    }
    return r;
  };
  const Result dense = run(RowDenseBatches::kAlways), segmented = run(RowDenseBatches::kNever);
  LoraLinear::set_row_dense_batches(RowDenseBatches::kOnGpu);
  EXPECT_TENSOR_CLOSE(dense.y, segmented.y, 1e-5, 1e-5);
  EXPECT_TENSOR_CLOSE(dense.grad_x, segmented.grad_x, 1e-5, 1e-5);
  for (size_t i = 0; i < dense.grad_a.size(); ++i) {
    EXPECT_TENSOR_CLOSE(dense.grad_a[i], segmented.grad_a[i], 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(dense.grad_b[i], segmented.grad_b[i], 1e-5, 1e-5);
    EXPECT_GT(dense.grad_b[i].abs().max().item<float>(), 0.0f);
  }
}

// adapter_update is forward minus the base product, with the same gradients into x and the factors (grouped expert
// GEMMs add it to their own base product): per-segment and row-dense, training and inference.
TEST_F(LoraLinearTest, AdapterUpdateIsForwardWithoutTheBase) {
  const std::vector<int64_t> slot_of_row = {1, 1, 2, 0, 3, 3, 3, 2, 1};
  for (RowDenseBatches policy : {RowDenseBatches::kNever, RowDenseBatches::kAlways}) {
    LoraLinear::set_row_dense_batches(policy);
    LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
    at::Generator gen = make_gen(5);
    {
      c10::NoGradGuard no_grad;
      for (int64_t slot = 1; slot < kSlots; ++slot) {
        lin.enable_slot(slot, slot, 0.5 * static_cast<double>(slot), gen);
        lin.set_factors(slot, randn({slot, kIn}, gen), randn({kOut, slot}, gen));
      }
    }
    const AdapterSegments segments = AdapterSegments::from_rows(slot_of_row, 1);
    at::Tensor weights = at::linspace(-1, 1, x_.size(0) * kOut).view({x_.size(0), kOut});  // [N, out]
    struct Pass {
      at::Tensor y, grad_x, grad_a, grad_b;
    };
    auto pass = [&](bool update_only) {
      at::Tensor x = x_.clone().requires_grad_(true);
      at::Tensor y = update_only ? lin.adapter_update(x, segments) + at::linear(x, weight_, bias_)
                                 : lin.forward(x, segments);
      (y * weights).sum().backward();
      Pass p{y.detach(), x.grad(), lin.lora_a_grad(3).clone(), lin.lora_b_grad(3).clone()};
      lin.zero_slot_grad(3);
      return p;
    };
    const Pass full = pass(false), update = pass(true);
    EXPECT_TENSOR_CLOSE(update.y, full.y, 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(update.grad_x, full.grad_x, 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(update.grad_a, full.grad_a, 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(update.grad_b, full.grad_b, 1e-5, 1e-5);
    EXPECT_GT(full.grad_a.abs().max().item<float>(), 0.0f);
    c10::NoGradGuard no_grad;
    EXPECT_TENSOR_CLOSE(lin.adapter_update(x_, segments) + at::linear(x_, weight_, bias_),
                        lin.forward(x_, segments), 1e-5, 1e-5);
    // No row with an adapter: nothing to add.
    EXPECT_FALSE(lin.adapter_update(x_, AdapterSegments::uniform(0, x_.size(0))).defined());
  }
  LoraLinear::set_row_dense_batches(RowDenseBatches::kOnGpu);
}

TEST_F(LoraLinearTest, ForwardAppliesEachSegmentsAdapter) {
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  lin.enable_slot(1, kMaxRank, 0.5, make_gen(1));
  lin.enable_slot(2, kMaxRank, 3.0, make_gen(2));
  at::Tensor a1 = randn({kMaxRank, kIn}, gen_), b1 = randn({kOut, kMaxRank}, gen_);
  at::Tensor a2 = randn({kMaxRank, kIn}, gen_), b2 = randn({kOut, kMaxRank}, gen_);
  lin.set_factors(1, a1, b1);
  lin.set_factors(2, a2, b2);
  EXPECT_TENSOR_EQ(lin.lora_a(1), a1);
  EXPECT_TENSOR_EQ(lin.lora_b(2), b2);

  // rows 0..2 slot 1, rows 3..6 slot 2, rows 7..8 base
  AdapterSegments segs({{1, 0, 3}, {2, 3, 4}, {0, 7, 2}});
  at::Tensor y = lin.forward(x_, segs);
  at::Tensor ref = at::cat({expected(x_.narrow(0, 0, 3), a1, b1, 0.5), expected(x_.narrow(0, 3, 4), a2, b2, 3.0),
                            expected(x_.narrow(0, 7, 2), at::Tensor(), at::Tensor(), 0.0)});
  EXPECT_TENSOR_CLOSE(y, ref, 1e-5, 1e-5);
  // The adapters really change the output.
  EXPECT_FALSE(at::allclose(y.narrow(0, 0, 7), at::linear(x_.narrow(0, 0, 7), weight_, bias_)));
}

TEST_F(LoraLinearTest, SlotNotEnabledHereGetsBaseOutput) {
  LoraLinear lin(weight_, at::Tensor(), kSlots, kMaxRank);
  lin.enable_slot(1, kMaxRank, 1.0, make_gen(1));
  lin.set_factors(1, randn({kMaxRank, kIn}, gen_), randn({kOut, kMaxRank}, gen_));
  at::Tensor y = lin.forward(x_, AdapterSegments({{1, 0, 4}, {3, 4, 5}}));  // slot 3 never enabled
  EXPECT_TRUE(at::equal(y.narrow(0, 4, 5), at::linear(x_.narrow(0, 4, 5), weight_)));
}

TEST_F(LoraLinearTest, SmallerRankUsesOnlyItsRank) {
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  lin.enable_slot(2, 2, 1.5, make_gen(3));
  EXPECT_EQ(lin.slot_rank(2), 2);
  EXPECT_EQ(lin.lora_a(2).sizes(), at::IntArrayRef({2, kIn}));
  EXPECT_EQ(lin.lora_b(2).sizes(), at::IntArrayRef({kOut, 2}));
  // Rows/columns beyond the rank start at zero ...
  EXPECT_EQ(lin.slot_storage_a(2).narrow(0, 2, kMaxRank - 2).abs().max().item<float>(), 0.0f);
  at::Tensor a = randn({2, kIn}, gen_), b = randn({kOut, 2}, gen_);
  lin.set_factors(2, a, b);
  {  // ... and garbage there must not be read.
    c10::NoGradGuard no_grad;
    lin.slot_storage_a(2).narrow(0, 2, kMaxRank - 2).fill_(100.0);
    lin.slot_storage_b(2).narrow(1, 2, kMaxRank - 2).fill_(100.0);
  }
  at::Tensor y = lin.forward(x_, AdapterSegments::uniform(2, x_.size(0)));
  EXPECT_TENSOR_CLOSE(y, expected(x_, a, b, 1.5), 1e-5, 1e-5);
}

TEST_F(LoraLinearTest, DisableSlotZeroesFactorsAndGrads) {
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  lin.enable_slot(1, kMaxRank, 1.0, make_gen(1));
  lin.enable_slot(2, kMaxRank, 1.0, make_gen(2));
  lin.set_factors(1, randn({kMaxRank, kIn}, gen_), randn({kOut, kMaxRank}, gen_));
  lin.set_factors(2, randn({kMaxRank, kIn}, gen_), randn({kOut, kMaxRank}, gen_));
  lin.forward(x_, AdapterSegments({{1, 0, 4}, {2, 4, 5}})).sum().backward();
  ASSERT_TRUE(lin.lora_a_grad(1).defined() && lin.lora_a_grad(2).defined());
  ASSERT_GT(lin.lora_a_grad(1).abs().max().item<float>(), 0.0f);
  ASSERT_GT(lin.lora_b_grad(1).abs().max().item<float>(), 0.0f);
  at::Tensor a2_before = lin.lora_a(2).detach().clone();
  at::Tensor grad_a2_before = lin.lora_a_grad(2).clone();

  lin.disable_slot(1);
  EXPECT_FALSE(lin.slot_enabled(1));
  EXPECT_EQ(lin.slot_storage_a(1).abs().max().item<float>(), 0.0f);
  EXPECT_EQ(lin.slot_storage_b(1).abs().max().item<float>(), 0.0f);
  EXPECT_FALSE(lin.lora_a_grad(1).defined());  // released with the slot
  EXPECT_FALSE(lin.lora_b_grad(1).defined());
  // The neighbour slot is untouched.
  EXPECT_TENSOR_EQ(lin.lora_a(2), a2_before);
  EXPECT_TENSOR_EQ(lin.lora_a_grad(2), grad_a2_before);
  // The disabled slot is back to the base output and set_factors is refused.
  EXPECT_TRUE(at::equal(lin.forward(x_, AdapterSegments::uniform(1, x_.size(0))), at::linear(x_, weight_, bias_)));
  EXPECT_THROW(lin.set_factors(1, randn({kMaxRank, kIn}, gen_), randn({kOut, kMaxRank}, gen_)), InvalidArgument);
  // A new tenant of slot 1 starts from zero gradients.
  lin.enable_slot(1, kMaxRank, 1.0, make_gen(5));
  EXPECT_FALSE(lin.lora_a_grad(1).defined());
}

TEST_F(LoraLinearTest, SetFactorsRejectsWrongShapes) {
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  lin.enable_slot(1, 3, 1.0, make_gen(1));
  at::Tensor good_a = randn({3, kIn}, gen_), good_b = randn({kOut, 3}, gen_);
  EXPECT_THROW(lin.set_factors(1, randn({kMaxRank, kIn}, gen_), good_b), InvalidArgument);  // max rank, not slot rank
  EXPECT_THROW(lin.set_factors(1, randn({3, kIn + 1}, gen_), good_b), InvalidArgument);
  EXPECT_THROW(lin.set_factors(1, good_a, randn({3, kOut}, gen_)), InvalidArgument);       // transposed
  EXPECT_THROW(lin.set_factors(1, good_a.unsqueeze(0), good_b), InvalidArgument);
  try {
    lin.set_factors(1, good_a, randn({kOut, 2}, gen_));
    ADD_FAILURE() << "wrong lora_B shape accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("lora_B"), std::string::npos) << e.what();
  }
  EXPECT_EQ(lin.lora_b(1).abs().max().item<float>(), 0.0f);  // nothing was written
  EXPECT_NO_THROW(lin.set_factors(1, good_a, good_b));
}

TEST_F(LoraLinearTest, SeedDeterminesInitialA) {
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  lin.enable_slot(1, kMaxRank, 1.0, make_gen(42));
  lin.enable_slot(2, kMaxRank, 1.0, make_gen(42));
  lin.enable_slot(3, kMaxRank, 1.0, make_gen(43));
  EXPECT_TENSOR_EQ(lin.lora_a(1), lin.lora_a(2));
  EXPECT_FALSE(at::equal(lin.lora_a(1), lin.lora_a(3)));
  // kaiming-uniform(a=sqrt(5)) bound = 1 / sqrt(in_features)
  const float bound = 1.0f / std::sqrt(static_cast<float>(kIn));
  EXPECT_LE(lin.lora_a(1).abs().max().item<float>(), bound);
  // Re-enabling the same slot with the same seed reproduces A exactly.
  at::Tensor first = lin.lora_a(1).detach().clone();
  lin.disable_slot(1);
  lin.enable_slot(1, kMaxRank, 1.0, make_gen(42));
  EXPECT_TENSOR_EQ(lin.lora_a(1), first);
}

TEST_F(LoraLinearTest, GradientsReachOnlyTheUsedSlot) {
  LoraLinear lin(weight_, bias_, kSlots, kMaxRank);
  const double scaling = 0.75;
  lin.enable_slot(1, kMaxRank, scaling, make_gen(1));
  lin.enable_slot(2, kMaxRank, scaling, make_gen(2));
  at::Tensor a1 = randn({kMaxRank, kIn}, gen_), b1 = randn({kOut, kMaxRank}, gen_);
  lin.set_factors(1, a1, b1);
  lin.set_factors(2, randn({kMaxRank, kIn}, gen_), randn({kOut, kMaxRank}, gen_));
  at::Tensor x = x_.narrow(0, 0, 6);
  lin.forward(x, AdapterSegments({{0, 0, 2}, {1, 2, 4}})).sum().backward();

  // Only the slot that had rows holds gradient buffers; the stacks themselves get no .grad.
  ASSERT_TRUE(lin.lora_a_grad(1).defined() && lin.lora_b_grad(1).defined());
  for (int64_t slot : {0, 2, 3}) {
    EXPECT_FALSE(lin.lora_a_grad(slot).defined()) << "slot " << slot;
    EXPECT_FALSE(lin.lora_b_grad(slot).defined()) << "slot " << slot;
  }
  EXPECT_FALSE(lin.stacked_a().grad().defined());
  EXPECT_FALSE(lin.stacked_b().grad().defined());
  at::Tensor ga = lin.lora_a_grad(1), gb = lin.lora_b_grad(1);
  // d/dB[o,r] sum = s * sum_n (x A^T)[n,r];  d/dA[r,i] sum = s * (sum_o B[o,r]) * (sum_n x[n,i])
  at::Tensor xs = x.narrow(0, 2, 4);
  at::Tensor expect_gb = scaling * at::matmul(xs, a1.t()).sum(0).unsqueeze(0).expand({kOut, kMaxRank});
  at::Tensor expect_ga = scaling * at::outer(b1.sum(0), xs.sum(0));
  EXPECT_TENSOR_CLOSE(gb, expect_gb, 1e-5, 1e-5);
  EXPECT_TENSOR_CLOSE(ga, expect_ga, 1e-5, 1e-5);
  // A second backward accumulates (Tinker: gradients add up until optim_step); zero_slot_grad resets.
  lin.forward(x, AdapterSegments({{0, 0, 2}, {1, 2, 4}})).sum().backward();
  EXPECT_TENSOR_CLOSE(lin.lora_a_grad(1), 2 * expect_ga, 1e-5, 1e-5);
  lin.zero_slot_grad(1);
  EXPECT_EQ(lin.lora_a_grad(1).abs().max().item<float>(), 0.0f);
  // The frozen base weight gets no gradient.
  EXPECT_FALSE(lin.weight().requires_grad());
}

}  // namespace
}  // namespace skyrl_tx::lora
