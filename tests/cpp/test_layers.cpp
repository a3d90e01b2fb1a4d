// Tests the decoder blocks (RmsNorm, SwiGluMlp, Attention, DecoderLayer, packed attention) against hand-written ATen
// formulas.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>

#include "common/errors.h"
#include "models/hf_weights.h"
#include "models/layers.h"
#include "models/packed_attention.h"
#include "models/rope.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::models {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;
using skyrl_tx::testing::ReferenceModel;

constexpr int64_t kSlots = 3, kMaxRank = 4;

ModelConfig no_qk_norm(ModelConfig c) {
  c.qk_norm = false;
  return c;
}

// cos/sin for positions 0..T-1 in every row.
std::pair<at::Tensor, at::Tensor> rope_tables(const ModelConfig& c, int64_t batch, int64_t seq) {
  at::Tensor positions = at::arange(seq, at::kLong).unsqueeze(0).expand({batch, seq});
  return RotaryEmbedding(c).cos_sin(positions, at::kFloat);
}

TEST(RmsNorm, MatchesFormula) {
  at::Generator gen = make_gen(1);
  at::Tensor w = randn({16}, gen), x = randn({3, 5, 16}, gen, 3.0);
  const double eps = 1e-5;
  at::Tensor y = RmsNorm(w, eps).forward(x);
  at::Tensor expected = w * x / at::sqrt(x.pow(2).mean(-1, true) + eps);
  EXPECT_TENSOR_CLOSE(y, expected, 1e-5, 1e-6);
  // Scale invariance (up to eps): the output ignores the input's magnitude.
  EXPECT_TENSOR_CLOSE(RmsNorm(w, 0.0).forward(x * 100.0), RmsNorm(w, 0.0).forward(x), 1e-5, 1e-6);
}

TEST(RmsNorm, Bf16InputNormalisesInFloat32) {
  at::Generator gen = make_gen(2);
  at::Tensor w = randn({32}, gen).to(at::kBFloat16), x = randn({4, 32}, gen).to(at::kBFloat16);
  at::Tensor y = RmsNorm(w, 1e-6).forward(x);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor expected = w.to(at::kFloat) * (x32 / at::sqrt(x32.pow(2).mean(-1, true) + 1e-6));
  EXPECT_TENSOR_CLOSE(y, expected, 2e-2, 2e-2);
}

// Qwen3.5's zero-centred norm scales by (1 + weight); in float32 it takes the fused CPU kernel with that scale. Its
// output and the gradients to x and to the (trained) weight equal Qwen3_5RMSNorm's formula.
TEST(RmsNorm, ZeroCenteredEqualsItsFormulaWithGradients) {
  at::Generator gen = make_gen(4);
  const at::Tensor w0 = randn({48}, gen, 0.1), x0 = randn({3, 5, 48}, gen, 3.0), upstream = randn({3, 5, 48}, gen);
  at::Tensor w = w0.clone().requires_grad_(true), x = x0.clone().requires_grad_(true);
  at::Tensor rw = w0.clone().requires_grad_(true), rx = x0.clone().requires_grad_(true);
  const at::Tensor y = RmsNorm(w, 1e-6, /*zero_centered=*/true).forward(x);
  const at::Tensor expected = rx / at::sqrt(rx.pow(2).mean(-1, true) + 1e-6) * (1.0 + rw);
  EXPECT_TENSOR_CLOSE(y, expected, 1e-5, 1e-6);
  (y * upstream).sum().backward();
  (expected * upstream).sum().backward();
  EXPECT_TENSOR_CLOSE(x.grad(), rx.grad(), 1e-5, 1e-5);
  EXPECT_TENSOR_CLOSE(w.grad(), rw.grad(), 1e-5, 1e-5);
}

TEST(SwiGluMlp, MatchesFormula) {
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  at::Generator gen = make_gen(3);
  WeightMap w;
  skyrl_tx::testing::add_mlp_weights(w, c, "mlp", gen);
  WeightStore store(w, at::kFloat, at::kCPU);
  BuildContext ctx{store, kSlots, kMaxRank};
  SwiGluMlp mlp(c, ctx, "mlp");
  EXPECT_NO_THROW(store.finish());

  at::Tensor x = randn({7, c.hidden_size}, gen);
  at::Tensor y = mlp.forward(x, lora::AdapterSegments::uniform(0, 7));
  at::Tensor gate = at::matmul(x, w["mlp.gate_proj.weight"].t()), up = at::matmul(x, w["mlp.up_proj.weight"].t());
  at::Tensor expected = at::matmul(gate * at::sigmoid(gate) * up, w["mlp.down_proj.weight"].t());
  EXPECT_TENSOR_CLOSE(y, expected, 1e-5, 1e-5);

  std::vector<NamedLoraModule> modules;
  mlp.collect_lora("mlp", modules);
  ASSERT_EQ(modules.size(), 3u);
  EXPECT_EQ(modules[0].name, "mlp.gate_proj");
  EXPECT_EQ(modules[2].name, "mlp.down_proj");
  EXPECT_EQ(modules[1].group, LoraGroup::kMlp);
  EXPECT_EQ(modules[2].module->in_features(), c.intermediate_size);
}

class AttentionTest : public ::testing::TestWithParam<bool> {};

TEST_P(AttentionTest, MatchesCausalGqaSoftmaxWithRope) {
  const bool qk_norm = GetParam();
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  c.qk_norm = qk_norm;
  at::Generator gen = make_gen(qk_norm ? 4 : 5);
  WeightMap w;
  skyrl_tx::testing::add_attention_weights(w, c, "attn", gen);
  WeightStore store(w, at::kFloat, at::kCPU);
  BuildContext ctx{store, kSlots, kMaxRank};
  Attention attn(c, ctx, "attn");
  EXPECT_NO_THROW(store.finish());

  const int64_t batch = 2, seq = 6;
  at::Tensor x = randn({batch, seq, c.hidden_size}, gen);
  auto [cos, sin] = rope_tables(c, batch, seq);
  at::Tensor y = attn.forward(x, cos, sin, AttentionMask{}, lora::AdapterSegments::uniform(0, batch * seq));
  ASSERT_EQ(y.sizes(), x.sizes());
  ReferenceModel ref{c, w};
  for (int64_t b = 0; b < batch; ++b) EXPECT_TENSOR_CLOSE(y[b], ref.attention(x[b], "attn"), 1e-5, 1e-5);

  // An explicit all-valid causal mask takes the masked path and must agree with the is_causal path.
  AttentionMask mask{at::ones({seq, seq}, at::kBool).tril().expand({batch, 1, seq, seq}).contiguous()};
  EXPECT_TENSOR_CLOSE(attn.forward(x, cos, sin, mask, lora::AdapterSegments::uniform(0, batch * seq)), y, 1e-5,
                      1e-5);
}

INSTANTIATE_TEST_SUITE_P(QkNorm, AttentionTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "qk_norm" : "plain"; });

TEST(Attention, QkNormChangesTheOutput) {
  // Guards the test above: with qk_norm on, a reference without it must disagree.
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  at::Generator gen = make_gen(6);
  WeightMap w;
  skyrl_tx::testing::add_attention_weights(w, c, "attn", gen);
  WeightStore store(w, at::kFloat, at::kCPU);
  BuildContext ctx{store, kSlots, kMaxRank};
  Attention attn(c, ctx, "attn");
  at::Tensor x = randn({1, 5, c.hidden_size}, gen);
  auto [cos, sin] = rope_tables(c, 1, 5);
  at::Tensor y = attn.forward(x, cos, sin, AttentionMask{}, lora::AdapterSegments::uniform(0, 5));
  ReferenceModel without{no_qk_norm(c), w};
  EXPECT_FALSE(at::allclose(y[0], without.attention(x[0], "attn"), 1e-3, 1e-3));
}

TEST(DecoderLayer, MatchesPreNormResidualFormulaWithLora) {
  ModelConfig c = skyrl_tx::testing::tiny_llama_config();
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;  // 4 query heads share one kv head
  at::Generator gen = make_gen(7);
  WeightMap w;
  skyrl_tx::testing::add_layer_weights(w, c, "layer", gen);
  WeightStore store(w, at::kFloat, at::kCPU);
  BuildContext ctx{store, kSlots, kMaxRank};
  DecoderLayer layer(c, ctx, "layer");
  EXPECT_NO_THROW(store.finish());

  const int64_t seq = 5;
  at::Tensor x = randn({1, seq, c.hidden_size}, gen);
  auto [cos, sin] = rope_tables(c, 1, seq);
  at::Tensor base = layer.forward(x, cos, sin, AttentionMask{}, lora::AdapterSegments::uniform(0, seq));
  ReferenceModel ref{c, w};
  EXPECT_TENSOR_CLOSE(base[0], ref.layer(x[0], "layer"), 1e-5, 1e-5);

  // LoRA on every projection (slot 2, rank 3) against the reference's x W^T + s (x A^T) B^T.
  std::vector<NamedLoraModule> modules;
  layer.collect_lora("layer", modules);
  ASSERT_EQ(modules.size(), 7u);
  EXPECT_EQ(modules[0].name, "layer.self_attn.q_proj");
  EXPECT_EQ(modules[0].group, LoraGroup::kAttention);
  EXPECT_EQ(modules[6].name, "layer.mlp.down_proj");
  ref.scaling = 0.5;
  for (const auto& m : modules) {
    m.module->enable_slot(2, 3, ref.scaling, make_gen(8));
    at::Tensor a = randn({3, m.module->in_features()}, gen, 0.3), b = randn({m.module->out_features(), 3}, gen, 0.3);
    m.module->set_factors(2, a, b);
    ref.lora[m.name + ".lora_A.weight"] = a;
    ref.lora[m.name + ".lora_B.weight"] = b;
  }
  at::Tensor adapted = layer.forward(x, cos, sin, AttentionMask{}, lora::AdapterSegments::uniform(2, seq));
  EXPECT_TENSOR_CLOSE(adapted[0], ref.layer(x[0], "layer"), 1e-5, 1e-5);
  EXPECT_FALSE(at::allclose(adapted, base, 1e-3, 1e-3));
}

TEST(WeightStore, TakesACopyEvenInTheComputeDtypeAndDevice) {
  // A checkpoint's tensors are views of the file's memory map: the model must own its weights.
  at::Tensor mapped = at::arange(12, at::kFloat).view({3, 4});
  WeightStore store({{"w", mapped}}, at::kFloat, at::kCPU);
  at::Tensor taken = store.take("w", {3, 4});
  EXPECT_NE(taken.data_ptr(), mapped.data_ptr());
  EXPECT_TRUE(at::equal(taken, mapped));
}

TEST(WeightStore, ReportsMissingUnexpectedAndMisshapedKeysAtOnce) {
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  at::Generator gen = make_gen(9);
  WeightMap w;
  skyrl_tx::testing::add_mlp_weights(w, c, "mlp", gen);
  w.erase("mlp.up_proj.weight");
  w["mlp.extra_proj.weight"] = randn({4, 4}, gen);
  w["mlp.down_proj.weight"] = randn({c.hidden_size, c.intermediate_size + 1}, gen);
  w["model.layers.0.self_attn.rotary_emb.inv_freq"] = randn({4}, gen);  // HF buffer: ignored
  WeightStore store(w, at::kFloat, at::kCPU);
  BuildContext ctx{store, kSlots, kMaxRank};
  SwiGluMlp mlp(c, ctx, "mlp");  // construction continues past the problems
  try {
    store.finish();
    ADD_FAILURE() << "finish() accepted a broken checkpoint";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("missing keys: mlp.up_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected keys: mlp.extra_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("mlp.down_proj.weight"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("inv_freq"), std::string::npos) << msg;
  }
}

TEST(WeightStore, TakeCastsAndOptionalMayBeAbsent) {
  at::Generator gen = make_gen(10);
  at::Tensor t = randn({3, 2}, gen);
  WeightStore store({{"a", t}}, at::kBFloat16, at::kCPU);
  EXPECT_FALSE(store.take_optional("absent", {1}).defined());
  at::Tensor a = store.take("a", {3, 2});
  EXPECT_EQ(a.scalar_type(), at::kBFloat16);
  EXPECT_TENSOR_CLOSE(a, t, 1e-2, 1e-2);
  EXPECT_NO_THROW(store.finish());
  at::Tensor missing = store.take("b", {2});  // zero placeholder, recorded as missing
  EXPECT_EQ(missing.sizes(), at::IntArrayRef({2}));
  EXPECT_THROW(store.finish(), InvalidArgument);
}

// Packed attention against each sequence alone (its own batch-of-one SDPA call): outputs and the gradients of q, k
// and v, with grouped-query heads and a value width unlike q/k's (as MLA has), over runs of equal and unequal lengths.
TEST(PackedAttentionTest, EqualsEachSequenceAlone) {
  at::Generator gen = make_gen(41);
  const std::vector<int64_t> lengths = {7, 3, 3, 3, 5, 1, 1};
  AttentionMask layout;
  layout.sequence_starts = {0};
  for (int64_t len : lengths) layout.sequence_starts.push_back(layout.sequence_starts.back() + len);
  layout.max_sequence_length = 7;
  const int64_t n = layout.sequence_starts.back();
  ASSERT_EQ(equal_length_runs(layout).size(), 4u);  // 7 | 3 3 3 | 5 | 1 1
  const double scale = 0.3;
  at::Tensor q = randn({1, 4, n, 8}, gen).requires_grad_(true);  // [1, heads, N, Dqk]
  at::Tensor k = randn({1, 2, n, 8}, gen).requires_grad_(true);  // [1, kv_heads, N, Dqk]
  at::Tensor v = randn({1, 2, n, 6}, gen).requires_grad_(true);  // [1, kv_heads, N, Dv]
  at::Tensor out = packed_causal_attention(q, k, v, layout, scale);  // [1, heads, N, Dv]
  ASSERT_EQ(out.sizes(), at::IntArrayRef({1, 4, n, 6}));
  at::Tensor weight = randn({1, 4, n, 6}, gen);
  (out * weight).sum().backward();
  for (size_t s = 0; s < lengths.size(); ++s) {
    SCOPED_TRACE("sequence " + std::to_string(s));
    const int64_t begin = layout.sequence_starts[s], len = lengths[s];
    at::Tensor qs = q.detach().narrow(2, begin, len).clone().requires_grad_(true);
    at::Tensor ks = k.detach().narrow(2, begin, len).clone().requires_grad_(true);
    at::Tensor vs = v.detach().narrow(2, begin, len).clone().requires_grad_(true);
    at::Tensor alone = at::scaled_dot_product_attention(qs, ks, vs, std::nullopt, 0.0, /*is_causal=*/true, scale,
                                                        /*enable_gqa=*/true);
    (alone * weight.narrow(2, begin, len)).sum().backward();
    EXPECT_TENSOR_CLOSE(out.detach().narrow(2, begin, len), alone.detach(), 1e-6, 1e-6);
    EXPECT_TENSOR_CLOSE(q.grad().narrow(2, begin, len), qs.grad(), 1e-6, 1e-6);
    EXPECT_TENSOR_CLOSE(k.grad().narrow(2, begin, len), ks.grad(), 1e-6, 1e-6);
    EXPECT_TENSOR_CLOSE(v.grad().narrow(2, begin, len), vs.grad(), 1e-6, 1e-6);
  }
  EXPECT_FALSE(packed_attention_uses_flash(q, v)) << "a CPU float32 row takes the SDPA path";
}

}  // namespace
}  // namespace skyrl_tx::models
