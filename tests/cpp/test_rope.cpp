// Tests models::RotaryEmbedding: inverse frequencies, cos/sin tables, the rotation, and Llama 3.1 scaling.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>

#include "models/rope.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::models {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

ModelConfig rope_config(int64_t head_dim, double theta) {
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  c.head_dim = head_dim;
  c.rope_theta = theta;
  return c;
}

ModelConfig llama3_config() {
  ModelConfig c = rope_config(128, 500000.0);
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  return c;
}

TEST(Rope, InvFreqMatchesFormula) {
  for (int64_t d : {8, 64, 128}) {
    ModelConfig c = rope_config(d, 10000.0);
    RotaryEmbedding rope(c);
    ASSERT_EQ(rope.inv_freq().sizes(), at::IntArrayRef({d / 2}));
    at::Tensor i = at::arange(d / 2, at::kDouble);
    at::Tensor expected = 1.0 / at::pow(10000.0, 2.0 * i / static_cast<double>(d));
    EXPECT_TENSOR_CLOSE(rope.inv_freq(), expected, 1e-6, 0);
  }
}

TEST(Rope, CosSinMatchFormula) {
  ModelConfig c = rope_config(16, 10000.0);
  RotaryEmbedding rope(c);
  at::Tensor positions = at::tensor({0, 1, 2, 7, 31, 3, 4, 5, 6, 9}, at::kLong).view({2, 5});
  auto [cos, sin] = rope.cos_sin(positions, at::kFloat);
  ASSERT_EQ(cos.sizes(), at::IntArrayRef({2, 5, 16}));
  ASSERT_EQ(cos.scalar_type(), at::kFloat);
  // angle[b, t, j] = pos[b, t] / theta^(2 (j mod 8) / 16), both halves of the head share frequencies
  at::Tensor j = at::arange(16, at::kDouble).remainder(8);
  at::Tensor inv_freq = 1.0 / at::pow(10000.0, 2.0 * j / 16.0);
  at::Tensor angle = positions.to(at::kDouble).unsqueeze(-1) * inv_freq;
  EXPECT_TENSOR_CLOSE(cos, angle.cos(), 0, 1e-5);
  EXPECT_TENSOR_CLOSE(sin, angle.sin(), 0, 1e-5);
  auto [cos_bf16, sin_bf16] = rope.cos_sin(positions, at::kBFloat16);
  EXPECT_EQ(cos_bf16.scalar_type(), at::kBFloat16);
  EXPECT_TENSOR_CLOSE(sin_bf16, angle.sin(), 0, 1e-2);
}

TEST(Rope, PositionZeroIsIdentity) {
  RotaryEmbedding rope(rope_config(8, 10000.0));
  auto [cos, sin] = rope.cos_sin(at::zeros({1, 3}, at::kLong), at::kFloat);
  at::Generator gen = make_gen(1);
  at::Tensor x = randn({1, 4, 3, 8}, gen);
  EXPECT_TENSOR_EQ(RotaryEmbedding::apply(x, cos, sin), x);
}

TEST(Rope, ApplyRotatesEachPairByItsAngle) {
  ModelConfig c = rope_config(8, 10000.0);
  RotaryEmbedding rope(c);
  at::Tensor positions = at::arange(6, at::kLong).view({1, 6}).repeat({2, 1}) + at::tensor({0, 3}).view({2, 1});
  auto [cos, sin] = rope.cos_sin(positions, at::kFloat);
  at::Generator gen = make_gen(2);
  at::Tensor x = randn({2, 3, 6, 8}, gen);  // [B, heads, T, D]
  at::Tensor y = RotaryEmbedding::apply(x, cos, sin);
  // (x_i, x_{i+4}) → (x_i cos - x_{i+4} sin, x_{i+4} cos + x_i sin), angle = pos * inv_freq[i]
  at::Tensor angle = positions.to(at::kFloat).unsqueeze(-1) * rope.inv_freq();  // [B, T, 4]
  at::Tensor ca = angle.cos().unsqueeze(1), sa = angle.sin().unsqueeze(1);     // [B, 1, T, 4]
  at::Tensor x1 = x.narrow(-1, 0, 4), x2 = x.narrow(-1, 4, 4);
  at::Tensor expected = at::cat({x1 * ca - x2 * sa, x2 * ca + x1 * sa}, -1);
  EXPECT_TENSOR_CLOSE(y, expected, 1e-5, 1e-6);

  // A rotation keeps each pair's norm ...
  at::Tensor y1 = y.narrow(-1, 0, 4), y2 = y.narrow(-1, 4, 4);
  EXPECT_TENSOR_CLOSE(y1 * y1 + y2 * y2, x1 * x1 + x2 * x2, 1e-5, 1e-5);
  // ... but changes the vector away from position 0.
  EXPECT_FALSE(at::allclose(y.select(2, 1), x.select(2, 1)));
}

TEST(Rope, RelativePositionOnlyMatters) {
  // <R(p) q, R(p + k) v> depends on k only: the property attention relies on.
  RotaryEmbedding rope(rope_config(8, 10000.0));
  at::Generator gen = make_gen(3);
  at::Tensor q = randn({1, 1, 1, 8}, gen), k = randn({1, 1, 1, 8}, gen);
  auto dot_at = [&](int64_t p, int64_t offset) {
    auto [cq, sq] = rope.cos_sin(at::full({1, 1}, p, at::kLong), at::kFloat);
    auto [ck, sk] = rope.cos_sin(at::full({1, 1}, p + offset, at::kLong), at::kFloat);
    return (RotaryEmbedding::apply(q, cq, sq) * RotaryEmbedding::apply(k, ck, sk)).sum().item<double>();
  };
  EXPECT_NEAR(dot_at(0, 3), dot_at(10, 3), 1e-4);
  EXPECT_NEAR(dot_at(2, 5), dot_at(20, 5), 1e-4);
}

TEST(Rope, DefaultTypeIsUnscaled) {
  ModelConfig c = rope_config(128, 500000.0);
  c.rope_scaling.factor = 8.0;  // ignored: type stays "default"
  at::Tensor i = at::arange(64, at::kDouble);
  EXPECT_TENSOR_CLOSE(RotaryEmbedding(c).inv_freq(), 1.0 / at::pow(500000.0, 2.0 * i / 128.0), 1e-6, 0);
}

TEST(Rope, Llama3KeepsHighAndDividesLowFrequencies) {
  ModelConfig c = llama3_config();
  at::Tensor scaled = RotaryEmbedding(c).inv_freq();
  ModelConfig plain_c = rope_config(128, 500000.0);
  at::Tensor plain = RotaryEmbedding(plain_c).inv_freq();
  ASSERT_EQ(scaled.sizes(), at::IntArrayRef({64}));
  // Highest frequency (wavelength 2*pi < 8192 / 4): unchanged.
  EXPECT_FLOAT_EQ(scaled[0].item<float>(), plain[0].item<float>());
  EXPECT_FLOAT_EQ(scaled[0].item<float>(), 1.0f);
  // Lowest frequency (wavelength > 8192 / 1): divided by factor.
  EXPECT_NEAR(scaled[63].item<double>(), plain[63].item<double>() / 8.0, 1e-6 * plain[63].item<double>());

  // Every frequency against the band formula written out element by element.
  EXPECT_TENSOR_CLOSE(scaled, skyrl_tx::testing::reference_inv_freq(c), 1e-6, 0);
  // Scaled frequencies never exceed the originals and never shrink below original / factor.
  EXPECT_TRUE((scaled <= plain * (1 + 1e-6)).all().item<bool>());
  EXPECT_TRUE((scaled >= plain / 8.0 * (1 - 1e-6)).all().item<bool>());
  // Some frequency is in the blended band (strictly between the two limits).
  at::Tensor medium = (scaled < plain * (1 - 1e-4)).logical_and(scaled > plain / 8.0 * (1 + 1e-4));
  EXPECT_GT(medium.sum().item<int64_t>(), 0);
}

}  // namespace
}  // namespace skyrl_tx::models
