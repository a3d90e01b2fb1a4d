// Tests MoeMlp (routing, expert grouping, per-expert LoRA in segmented and row-dense batches, router gradient)
// against a per-token reference written from the formula, and the registry's layouts.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "lora/lora_linear.h"
#include "models/architectures.h"
#include "models/moe.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::models {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

constexpr int64_t kMoeSlots = 3, kMoeMaxRank = 4, kTokensPerRow = 5;

ModelConfig moe_config(int64_t shared) {
  ModelConfig c = skyrl_tx::testing::tiny_qwen3_config();
  c.architecture = "Qwen3MoeForCausalLM";
  c.num_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 8;
  c.norm_topk_prob = true;
  c.n_shared_experts = shared;
  return c;
}

WeightMap moe_weights(const ModelConfig& c, at::Generator& gen) {
  WeightMap w;
  w["mlp.gate.weight"] = randn({c.num_experts, c.hidden_size}, gen, 0.5);
  ModelConfig expert = c;
  expert.intermediate_size = c.moe_intermediate_size;
  for (int64_t e = 0; e < c.num_experts; ++e) {
    skyrl_tx::testing::add_mlp_weights(w, expert, "mlp.experts." + std::to_string(e), gen);
  }
  expert.intermediate_size = c.n_shared_experts * c.moe_intermediate_size;
  if (c.n_shared_experts > 0) skyrl_tx::testing::add_mlp_weights(w, expert, "mlp.shared_experts", gen);
  return w;
}

// x W^T + scaling * (x A^T) B^T for `slot` (slot 0 or a disabled slot: the base only).
at::Tensor lora_linear(const lora::LoraLinear& m, const at::Tensor& x, int64_t slot) {
  at::Tensor y = at::matmul(x, m.weight().t());
  if (slot > 0 && m.slot_enabled(slot)) y = y + m.slot_scaling(slot) * at::matmul(at::matmul(x, m.lora_a(slot).t()),
                                                                                m.lora_b(slot).t());
  return y;
}

at::Tensor swiglu(const std::vector<NamedLoraModule>& mods, size_t first, const at::Tensor& x, int64_t slot) {
  at::Tensor g = lora_linear(*mods[first].module, x, slot), u = lora_linear(*mods[first + 1].module, x, slot);
  return lora_linear(*mods[first + 2].module, at::silu(g) * u, slot);
}

// DeepSeek V3's router for one token, written out: the best topk_group groups by their two best biased scores,
// then the best k biased scores among those groups; weights are the unbiased scores, renormalised and scaled.
std::pair<at::Tensor, at::Tensor> sigmoid_route(const ModelConfig& c, const at::Tensor& gate, const at::Tensor& bias,
                                                const at::Tensor& xn) {
  at::Tensor scores = at::sigmoid(at::matmul(xn, gate.t()))[0];  // [E]
  at::Tensor choice = scores + bias;
  const int64_t per_group = c.num_experts / c.n_group;
  std::vector<std::pair<double, int64_t>> groups;
  for (int64_t g = 0; g < c.n_group; ++g) {
    at::Tensor sorted = std::get<0>(choice.narrow(0, g * per_group, per_group).sort(0, /*descending=*/true));
    groups.emplace_back(-(sorted[0] + sorted[1]).item<double>(), g);
  }
  std::sort(groups.begin(), groups.end());
  std::vector<std::pair<double, int64_t>> eligible;
  for (int64_t j = 0; j < c.topk_group; ++j) {
    for (int64_t e = groups[j].second * per_group; e < (groups[j].second + 1) * per_group; ++e) {
      eligible.emplace_back(-choice[e].item<double>(), e);
    }
  }
  std::sort(eligible.begin(), eligible.end());
  std::vector<int64_t> idx;
  for (int64_t j = 0; j < c.num_experts_per_tok; ++j) idx.push_back(eligible[j].second);
  at::Tensor index = at::tensor(idx, at::kLong);
  at::Tensor w = scores.index_select(0, index);
  w = w / w.sum() * c.routed_scaling_factor;
  return {w.unsqueeze(0), index.unsqueeze(0)};
}

// Token by token: the router, top-k, renormalise, weighted sum of the chosen experts (+ shared experts).
at::Tensor reference(const ModelConfig& c, const at::Tensor& gate, const std::vector<NamedLoraModule>& mods,
                     const at::Tensor& x, const std::vector<int64_t>& slot_of_token, const at::Tensor& bias = {}) {
  std::vector<at::Tensor> rows;
  for (int64_t n = 0; n < x.size(0); ++n) {
    at::Tensor xn = x.narrow(0, n, 1);  // [1, hidden]
    at::Tensor w, idx;
    if (c.scoring_func == "sigmoid") {
      std::tie(w, idx) = sigmoid_route(c, gate, bias, xn);
    } else {
      std::tie(w, idx) = at::topk(at::softmax(at::matmul(xn, gate.t()), -1), c.num_experts_per_tok, -1);
      w = w / w.sum(-1, true);
    }
    at::Tensor y = at::zeros_like(xn);
    for (int64_t j = 0; j < c.num_experts_per_tok; ++j) {
      const int64_t e = idx[0][j].item<int64_t>();
      y = y + w.select(1, j).unsqueeze(1) * swiglu(mods, 3 * e, xn, slot_of_token[n]);
    }
    if (c.n_shared_experts > 0) y = y + swiglu(mods, 3 * c.num_experts, xn, slot_of_token[n]);
    rows.push_back(y);
  }
  return at::cat(rows);
}

struct MoeFixture {
  ModelConfig config;
  WeightMap weights;
  std::unique_ptr<MoeMlp> mlp;
  std::vector<NamedLoraModule> mods;
  at::Tensor gate;

  explicit MoeFixture(int64_t shared, uint64_t seed) : MoeFixture(moe_config(shared), seed) {}
  MoeFixture(ModelConfig c, uint64_t seed) : config(std::move(c)) {
    at::Generator gen = make_gen(seed);
    weights = moe_weights(config, gen);
    if (config.scoring_func == "sigmoid") weights["mlp.gate.e_score_correction_bias"] = randn({config.num_experts}, gen,
                                                                                             0.3);
    WeightStore store(weights, at::kFloat, at::kCPU);
    BuildContext ctx{store, kMoeSlots, kMoeMaxRank};
    mlp = std::make_unique<MoeMlp>(config, ctx, "mlp");
    store.finish();
    mlp->collect_lora("mlp", mods);
    // Slot 1: rank 2, slot 2: rank 4; random nonzero A and B on every expert projection.
    for (const NamedLoraModule& m : mods) {
      for (auto [slot, rank] : {std::pair<int64_t, int64_t>{1, 2}, {2, 4}}) {
        m.module->load_slot(slot, rank, 0.5 * slot, randn({rank, m.module->in_features()}, gen, 0.3),
                            randn({m.module->out_features(), rank}, gen, 0.3));
      }
    }
    std::vector<NamedParameter> params;
    mlp->collect_parameters("mlp", params);
    gate = params.at(0).second;
  }
};

class MoeMlpTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(MoeMlpTest, SegmentedAndRowDenseBatchesEqualThePerTokenFormula) {
  MoeFixture f(GetParam(), 11);
  EXPECT_EQ(f.mods.size(), static_cast<size_t>(3 * (f.config.num_experts + (GetParam() > 0 ? 1 : 0))));
  EXPECT_EQ(f.mods[0].name, "mlp.experts.0.gate_proj");
  EXPECT_EQ(f.mods[5].name, "mlp.experts.1.down_proj");
  at::Generator gen = make_gen(12);
  const std::vector<int64_t> row_slots{1, 0, 2, 2};  // unsorted rows, a base row between adapters
  const int64_t n = static_cast<int64_t>(row_slots.size()) * kTokensPerRow;
  at::Tensor x = randn({n, f.config.hidden_size}, gen);
  std::vector<int64_t> slot_of_token;
  for (int64_t s : row_slots) slot_of_token.insert(slot_of_token.end(), kTokensPerRow, s);
  at::Tensor expected = reference(f.config, f.gate, f.mods, x, slot_of_token);

  at::Tensor segmented = f.mlp->forward(x, lora::AdapterSegments::from_rows(row_slots, kTokensPerRow));
  EXPECT_TENSOR_CLOSE(segmented, expected, 1e-5, 1e-5);
  lora::LoraLinear::set_row_dense_batches(lora::RowDenseBatches::kAlways);
  c10::NoGradGuard inference;  // the row-dense path serves sampling only
  at::Tensor row_slot = at::tensor(slot_of_token, at::kLong);
  at::Tensor row_dense =
      f.mlp->forward(x, lora::AdapterSegments::row_dense(lora::slot_columns(row_slot, kMoeSlots, kMoeMaxRank)));
  lora::LoraLinear::set_row_dense_batches(lora::RowDenseBatches::kOnGpu);
  EXPECT_TENSOR_CLOSE(row_dense, expected, 1e-5, 1e-5);
  // The adapters matter (else the checks above would not see a wrong slot).
  at::Tensor base = f.mlp->forward(x, lora::AdapterSegments::uniform(0, n));
  EXPECT_FALSE(at::allclose(base, expected, 1e-3, 1e-3));
}

INSTANTIATE_TEST_SUITE_P(SharedExperts, MoeMlpTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return info.param ? std::string("shared") : std::string("routed_only");
                         });

TEST(MoeMlp, RoutingKeepsEveryTokenAndGroupsByExpert) {
  MoeFixture f(0, 21);
  at::Generator gen = make_gen(22);
  at::Tensor x = randn({13, f.config.hidden_size}, gen);
  ExpertRouting r = f.mlp->route(x);
  int64_t total = 0;
  for (int64_t c : r.count) total += c;
  EXPECT_EQ(total, 13 * f.config.num_experts_per_tok);  // no capacity factor: nothing dropped
  // Each token appears exactly top-k times; within an expert, tokens ascend (adapter segments stay contiguous).
  EXPECT_TENSOR_EQ(at::bincount(r.token, {}, 13), at::full({13}, f.config.num_experts_per_tok, at::kLong));
  int64_t offset = 0;
  for (int64_t c : r.count) {
    if (c > 1) {
      at::Tensor t = r.token.narrow(0, offset, c);
      EXPECT_TRUE((t.narrow(0, 1, c - 1) > t.narrow(0, 0, c - 1)).all().item<bool>());
    }
    offset += c;
  }
  // norm_topk_prob: each token's weights sum to 1.
  at::Tensor sums = at::zeros({13}).index_add(0, r.token, r.weight);
  EXPECT_TENSOR_CLOSE(sums, at::ones({13}), 1e-6, 1e-6);
}

TEST(MoeMlp, RouterAndExpertLoraGradientsEqualTheReference) {
  MoeFixture f(1, 31);
  at::Generator gen = make_gen(32);
  const std::vector<int64_t> row_slots{2, 1};
  at::Tensor x = randn({2 * kTokensPerRow, f.config.hidden_size}, gen);
  at::Tensor probe = randn({2 * kTokensPerRow, f.config.hidden_size}, gen);
  std::vector<int64_t> slot_of_token;
  for (int64_t s : row_slots) slot_of_token.insert(slot_of_token.end(), kTokensPerRow, s);
  f.gate.requires_grad_(true);

  (f.mlp->forward(x, lora::AdapterSegments::from_rows(row_slots, kTokensPerRow)) * probe).sum().backward();
  at::Tensor gate_grad = f.gate.grad().clone();
  std::vector<at::Tensor> ours;
  for (const NamedLoraModule& m : f.mods) ours.push_back(m.module->lora_a_grad(2).clone());
  // The reference through plain autograd (its LoRA terms use lora_a/lora_b views, so only the router is compared).
  f.gate.mutable_grad() = at::Tensor();
  (reference(f.config, f.gate, f.mods, x, slot_of_token) * probe).sum().backward();
  EXPECT_TENSOR_CLOSE(gate_grad, f.gate.grad(), 1e-5, 1e-6);
  EXPECT_GT(gate_grad.abs().max().item<double>(), 0.0);
  // Expert LoRA gradients: finite and nonzero for the experts these tokens reach.
  int64_t nonzero = 0;
  for (const at::Tensor& g : ours) nonzero += g.defined() && g.abs().max().item<double>() > 0;
  EXPECT_GE(nonzero, 6);
}

TEST(MoeMlp, DeepSeekSigmoidGroupLimitedRouterEqualsTheFormula) {
  ModelConfig c = moe_config(/*shared=*/1);
  c.scoring_func = "sigmoid";
  c.num_experts = 8;
  c.num_experts_per_tok = 3;
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling_factor = 2.5;
  ASSERT_NO_THROW(c.validate());
  MoeFixture f(c, 41);
  at::Generator gen = make_gen(42);
  const std::vector<int64_t> row_slots{0, 2, 1};
  at::Tensor x = randn({3 * kTokensPerRow, c.hidden_size}, gen);
  std::vector<int64_t> slot_of_token;
  for (int64_t s : row_slots) slot_of_token.insert(slot_of_token.end(), kTokensPerRow, s);
  at::Tensor bias = f.weights.at("mlp.gate.e_score_correction_bias");
  at::Tensor expected = reference(c, f.gate, f.mods, x, slot_of_token, bias);
  EXPECT_TENSOR_CLOSE(f.mlp->forward(x, lora::AdapterSegments::from_rows(row_slots, kTokensPerRow)), expected, 1e-5,
                      1e-5);
  // The bias matters: without it the choice (hence the output) differs.
  at::Tensor unbiased = reference(c, f.gate, f.mods, x, slot_of_token, at::zeros_like(bias));
  EXPECT_FALSE(at::allclose(unbiased, expected, 1e-4, 1e-4));
}

TEST(Architectures, LayoutsFollowTheConfig) {
  ModelConfig c = moe_config(0);
  c.num_hidden_layers = 4;
  c.mlp_only_layers = {0};
  c.decoder_sparse_step = 2;
  EXPECT_EQ(mlp_layout(c), (std::vector<MlpKind>{MlpKind::kDense, MlpKind::kMoe, MlpKind::kDense, MlpKind::kMoe}));
  c.architecture = "Qwen3ForCausalLM";
  EXPECT_EQ(mlp_layout(c), std::vector<MlpKind>(4, MlpKind::kDense));
  c.architecture = "MixtralForCausalLM";
  EXPECT_THROW((void)mlp_layout(c), Unimplemented);
}

TEST(Architectures, MlaCachesTheLatentNotKeysAndValues) {
  ModelConfig c = moe_config(1);
  c.architecture = "DeepseekV3ForCausalLM";
  c.scoring_func = "sigmoid";
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.head_dim = 8;
  c.v_head_dim = 16;
  ASSERT_NO_THROW(c.validate());
  EXPECT_EQ(c.cache_kv_heads(), 1);
  EXPECT_EQ(c.cache_key_dim(), 16 + 8);  // kv_lora_rank + qk_rope_head_dim per token, not heads x (K + V)
  EXPECT_EQ(c.cache_value_dim(), 0);
  c.head_dim = 16;  // MLA's head_dim is the RoPE part
  EXPECT_THROW(c.validate(), InvalidArgument);
  ModelConfig gqa = moe_config(0);
  EXPECT_EQ(gqa.cache_key_dim(), gqa.resolved_head_dim());
  EXPECT_EQ(gqa.cache_kv_heads(), gqa.num_key_value_heads);
}

TEST(Architectures, MoeConfigIsValidated) {
  ModelConfig c = moe_config(0);
  EXPECT_NO_THROW(c.validate());
  c.num_experts_per_tok = 7;  // > num_experts
  EXPECT_THROW(c.validate(), InvalidArgument);
}

}  // namespace
}  // namespace skyrl_tx::models
