// Tests the fused CPU kernels (ops/swiglu, ops/rmsnorm_cpu, ops/rope_cpu, ops/decode_attention_cpu) against their ATen
// twins: outputs and every gradient.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>

#include "ops/decode_attention_cpu.h"
#include "ops/rmsnorm_cpu.h"
#include "ops/rope_cpu.h"
#include "ops/swiglu.h"
#include "testing/tensor_asserts.h"
#include "testing/tiny_model.h"

namespace skyrl_tx::ops {
namespace {

using skyrl_tx::testing::make_gen;
using skyrl_tx::testing::randn;

// The fused ops run by default (ops/cpu_vector_kernels.h); a run with SKYRL_TX_FUSED_CPU_OPS=0 would test nothing.
const bool kFusedOpsOn = unsetenv("SKYRL_TX_FUSED_CPU_OPS") == 0;

// Shapes with a ragged vector tail (width 37) and several parallel tasks (2 x 300 x 96 elements).
const std::vector<std::vector<int64_t>> kShapes = {{5, 37}, {2, 300, 96}, {1, 3, 4, 64}};

TEST(CpuKernels, SwigluEqualsAtenForwardAndBackward) {
  ASSERT_TRUE(kFusedOpsOn);
  for (const auto& shape : kShapes) {
    at::Generator gen = make_gen(11);
    at::Tensor g0 = randn(shape, gen) * 3, u0 = randn(shape, gen), weights = randn(shape, gen);
    at::Tensor g = g0.clone().requires_grad_(true), u = u0.clone().requires_grad_(true);
    at::Tensor rg = g0.clone().requires_grad_(true), ru = u0.clone().requires_grad_(true);
    ASSERT_TRUE(swiglu_is_fused(g, u));
    at::Tensor out = swiglu(g, u), ref = at::silu(rg) * ru;
    EXPECT_TENSOR_CLOSE(out, ref, 1e-6, 1e-6);
    (out * weights).sum().backward();
    (ref * weights).sum().backward();
    EXPECT_TENSOR_CLOSE(g.grad(), rg.grad(), 1e-5, 1e-6);
    EXPECT_TENSOR_CLOSE(u.grad(), ru.grad(), 1e-5, 1e-6);
  }
}

// A token's activations must not change with the batch around it (sampling a frozen snapshot twice, with other
// rows or a cached prefix the second time, gives the same logprobs): every element takes the same arithmetic
// wherever it lands in the vector loop, ragged tail included.
TEST(CpuKernels, SwigluOfAnElementDoesNotDependOnItsPosition) {
  at::Generator gen = make_gen(14);
  at::Tensor g = randn({7, 37}, gen) * 3, u = randn({7, 37}, gen);
  at::Tensor whole = swiglu(g, u);
  for (int64_t row = 0; row < 7; ++row) {
    EXPECT_TENSOR_EQ(swiglu(g.narrow(0, row, 1).contiguous(), u.narrow(0, row, 1).contiguous()),
                     whole.narrow(0, row, 1));
  }
  at::Tensor gg = g.clone().requires_grad_(true), uu = u.clone().requires_grad_(true);
  swiglu(gg, uu).sum().backward();
  at::Tensor g1 = g.narrow(0, 3, 1).contiguous().requires_grad_(true), u1 = u.narrow(0, 3, 1).contiguous();
  swiglu(g1, u1).sum().backward();
  EXPECT_TENSOR_EQ(g1.grad(), gg.grad().narrow(0, 3, 1));
}

TEST(CpuKernels, SwigluGivesOnlyTheGradientsAsked) {
  at::Generator gen = make_gen(12);
  at::Tensor g = randn({4, 40}, gen), u = randn({4, 40}, gen).requires_grad_(true);
  ops::swiglu(g, u).sum().backward();
  EXPECT_FALSE(g.grad().defined());
  EXPECT_TENSOR_CLOSE(u.grad(), at::silu(g), 1e-6, 1e-6);
}

// Rows strided out of a wider tensor (one projection's output split in two; several rows of a batch) take the
// kernel as each row alone does (one row of a narrow is contiguous): were the path chosen by layout, a token's
// activations would differ by an ulp between a prefill and a one-token step. Other dtypes take the ATen formula.
TEST(CpuKernels, SwigluOfStridedRowsEqualsEachRowAloneBitForBit) {
  at::Generator gen = make_gen(13);
  at::Tensor both = randn({6, 2 * 37}, gen) * 3;  // [rows, gate | up]
  at::Tensor g = both.narrow(1, 0, 37), u = both.narrow(1, 37, 37);
  ASSERT_FALSE(g.is_contiguous());
  EXPECT_TRUE(swiglu_is_fused(g, u));
  const at::Tensor whole = swiglu(g, u);
  for (int64_t row = 0; row < 6; ++row) {
    ASSERT_TRUE(g.narrow(0, row, 1).is_contiguous());
    EXPECT_TENSOR_EQ(swiglu(g.narrow(0, row, 1), u.narrow(0, row, 1)), whole.narrow(0, row, 1));
  }
  at::Tensor b = both.clone().requires_grad_(true);
  swiglu(b.narrow(1, 0, 37), b.narrow(1, 37, 37)).sum().backward();
  at::Tensor r = both.narrow(0, 2, 1).clone().requires_grad_(true);
  swiglu(r.narrow(1, 0, 37), r.narrow(1, 37, 37)).sum().backward();
  EXPECT_TENSOR_EQ(r.grad(), b.grad().narrow(0, 2, 1));
  EXPECT_FALSE(swiglu_is_fused(g.to(at::kDouble), u.to(at::kDouble)));
  EXPECT_TENSOR_CLOSE(swiglu(g.to(at::kDouble), u.to(at::kDouble)), at::silu(g.to(at::kDouble)) * u.to(at::kDouble),
                      0, 0);
}

// RmsNorm's ATen formula (models/layers.cpp): w * (x * rsqrt(mean(x^2) + eps)).
at::Tensor aten_rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

TEST(CpuKernels, RmsNormEqualsAtenForwardAndBackward) {
  for (const auto& shape : kShapes) {
    at::Generator gen = make_gen(21);
    const int64_t dim = shape.back();
    at::Tensor x0 = randn(shape, gen) * 2, w0 = randn({dim}, gen), weights = randn(shape, gen);
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor rx = x0.clone().requires_grad_(true), rw = w0.clone().requires_grad_(true);
    ASSERT_TRUE(rmsnorm_cpu_applies(x, w));
    at::Tensor out = rmsnorm_cpu(x, w, 1e-6), ref = aten_rmsnorm(rx, rw, 1e-6);
    EXPECT_TENSOR_CLOSE(out, ref, 1e-5, 1e-6);
    (out * weights).sum().backward();
    (ref * weights).sum().backward();
    EXPECT_TENSOR_CLOSE(x.grad(), rx.grad(), 1e-4, 1e-5);
    EXPECT_TENSOR_CLOSE(w.grad(), rw.grad(), 1e-4, 1e-5);
  }
}

TEST(CpuKernels, RmsNormFrozenWeightGetsNoGradient) {
  at::Generator gen = make_gen(22);
  at::Tensor x = randn({3, 48}, gen).requires_grad_(true), w = randn({48}, gen);
  rmsnorm_cpu(x, w, 1e-5).sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
  EXPECT_FALSE(rmsnorm_cpu_applies(x.to(at::kDouble), w.to(at::kDouble)));
}

// As SwigluOfStridedRowsEqualsEachRowAloneBitForBit: a norm over rows narrowed out of a wider projection (MLA's
// compressed kv beside its rope part) gives each row what the row alone gets.
TEST(CpuKernels, RmsNormOfStridedRowsEqualsEachRowAloneBitForBit) {
  at::Generator gen = make_gen(23);
  at::Tensor wide = randn({5, 48 + 16}, gen) * 2, w = randn({48}, gen);
  at::Tensor x = wide.narrow(1, 0, 48);  // [5, 48], row stride 64
  ASSERT_FALSE(x.is_contiguous());
  ASSERT_TRUE(rmsnorm_cpu_applies(x, w));
  const at::Tensor whole = rmsnorm_cpu(x, w, 1e-6);
  for (int64_t row = 0; row < 5; ++row) {
    EXPECT_TENSOR_EQ(rmsnorm_cpu(x.narrow(0, row, 1), w, 1e-6), whole.narrow(0, row, 1));
  }
  at::Tensor grown = wide.clone().requires_grad_(true);
  (rmsnorm_cpu(grown.narrow(1, 0, 48), w, 1e-6) * whole).sum().backward();
  at::Tensor one = wide.narrow(0, 1, 1).clone().requires_grad_(true);
  (rmsnorm_cpu(one.narrow(1, 0, 48), w, 1e-6) * whole.narrow(0, 1, 1)).sum().backward();
  EXPECT_TENSOR_EQ(one.grad(), grown.grad().narrow(0, 1, 1));
}

// RotaryEmbedding::apply's ATen formula (models/rope.cpp): x * cos + [-x2, x1] * sin, cos/sin over heads.
at::Tensor aten_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

// Products rounded, then summed, as ATen does (the kernels' file builds without FMA contraction): equal bit for bit,
// forward and backward, for q/k laid out as the model makes them ([B, T, heads, D] memory seen as [B, heads, T, D]),
// contiguous, with a ragged vector tail (half = 37) and with angles shared by the batch ([1, T, D]).
TEST(CpuKernels, RopeEqualsAtenForwardAndBackwardBitForBit) {
  struct Case {
    int64_t batch, tokens, heads, dim, angle_batch;
    bool transposed;
  };
  for (const Case& k : {Case{2, 5, 3, 64, 2, true}, Case{2, 5, 3, 64, 1, false}, Case{1, 7, 2, 74, 1, true}}) {
    at::Generator gen = make_gen(31);
    at::Tensor base = randn({k.batch, k.tokens, k.heads, k.dim}, gen);  // [B, T, heads, D]
    at::Tensor angles = randn({k.angle_batch, k.tokens, k.dim}, gen);
    const at::Tensor cos = angles.cos(), sin = angles.sin();  // [B or 1, T, D]
    const at::Tensor weights = randn({k.batch, k.heads, k.tokens, k.dim}, gen);
    at::Tensor mine = base.clone().requires_grad_(true), ref = base.clone().requires_grad_(true);
    const auto layout = [&](const at::Tensor& t) { return k.transposed ? t.transpose(1, 2) : t.transpose(1, 2).contiguous(); };
    ASSERT_TRUE(rope_cpu_applies(layout(mine), cos, sin));
    const at::Tensor out = rope_cpu(layout(mine), cos, sin), expected = aten_rope(layout(ref), cos, sin);
    EXPECT_TENSOR_EQ(out, expected);
    (out * weights).sum().backward();
    (expected * weights).sum().backward();
    EXPECT_TENSOR_EQ(mine.grad(), ref.grad());
  }
}

// Each token alone (a one-token decode step) gets what it gets inside a prefill; other dtypes keep the formula.
TEST(CpuKernels, RopeOfOneTokenEqualsItsRowInAPrefillBitForBit) {
  at::Generator gen = make_gen(32);
  const at::Tensor x = randn({2, 6, 4, 64}, gen).transpose(1, 2);  // [B, heads, T, D], strided
  const at::Tensor angles = randn({2, 6, 64}, gen), cos = angles.cos(), sin = angles.sin();
  const at::Tensor whole = rope_cpu(x, cos, sin);
  for (int64_t t = 0; t < 6; ++t) {
    EXPECT_TENSOR_EQ(rope_cpu(x.narrow(2, t, 1), cos.narrow(1, t, 1), sin.narrow(1, t, 1)), whole.narrow(2, t, 1));
  }
  EXPECT_FALSE(rope_cpu_applies(x.to(at::kDouble), cos.to(at::kDouble), sin.to(at::kDouble)));
  EXPECT_FALSE(rope_cpu_applies(x.narrow(-1, 0, 63), cos.narrow(-1, 0, 63), sin.narrow(-1, 0, 63)));  // odd D
}

// The twin: models::Attention's eager decode without the kernel. Each row's new key and value go into its cache row
// at its position (index_put), then masked SDPA over keys [0, attend_len), key j visible to row b when j <= its
// position.
at::Tensor aten_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                 at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& positions,
                                 int64_t attend_len, double scale) {
  using at::indexing::Slice;
  k_cache.index_put_({rows, Slice(), positions}, k.select(2, 0));  // [B, kv_heads, D]
  v_cache.index_put_({rows, Slice(), positions}, v.select(2, 0));
  const at::Tensor keys = k_cache.index_select(0, rows).narrow(2, 0, attend_len);  // [B, kv_heads, L, D]
  const at::Tensor values = v_cache.index_select(0, rows).narrow(2, 0, attend_len);
  const at::Tensor mask = (at::arange(attend_len, positions.options()).unsqueeze(0) <= positions.unsqueeze(1))
                              .view({q.size(0), 1, 1, attend_len});
  return at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scale,
                                          /*enable_gqa=*/q.size(1) != k.size(1));
}

// GQA (2 query heads per kv head) at the bench's head width, one kv head for every query head with a ragged vector
// tail (D = 36), multi-query with narrower values (MLA-like); rows in another order than the batch's, one row past
// attend_len (a free row riding along at the last position, whose keys are cut at attend_len).
TEST(CpuKernels, DecodeAttentionEqualsCacheWriteAndMaskedSdpa) {
  struct Case {
    int64_t batch, heads, kv_heads, dim, value_dim, max_len, attend_len;
  };
  c10::NoGradGuard no_grad;
  for (const Case& c : {Case{5, 8, 4, 64, 64, 40, 30}, Case{3, 3, 3, 36, 36, 12, 12}, Case{4, 4, 1, 16, 8, 20, 9}}) {
    at::Generator gen = make_gen(41);
    const at::Tensor q = randn({c.batch, 1, c.heads, c.dim}, gen).transpose(1, 2);  // [B, heads, 1, D], strided
    const at::Tensor k = randn({c.batch, 1, c.kv_heads, c.dim}, gen).transpose(1, 2);
    const at::Tensor v = randn({c.batch, 1, c.kv_heads, c.value_dim}, gen).transpose(1, 2);
    const at::Tensor k_past = randn({c.batch + 2, c.kv_heads, c.max_len, c.dim}, gen);  // rows: two to spare
    const at::Tensor v_past = randn({c.batch + 2, c.kv_heads, c.max_len, c.value_dim}, gen);
    const at::Tensor rows = at::randperm(c.batch + 2, gen).narrow(0, 0, c.batch);
    at::Tensor positions = at::randint(c.attend_len, {c.batch}, gen, at::kLong);
    positions[0] = c.max_len - 1;
    positions[1] = c.attend_len - 1;
    at::Tensor k_cache = k_past.clone(), v_cache = v_past.clone(), k_ref = k_past.clone(), v_ref = v_past.clone();
    ASSERT_TRUE(decode_attention_cpu_applies(q, k_cache, v_cache));
    const at::Tensor out = decode_attention_cpu(q, k, v, k_cache, v_cache, rows, positions, c.attend_len, 0.3);
    const at::Tensor expected = aten_decode_attention(q, k, v, k_ref, v_ref, rows, positions, c.attend_len, 0.3);
    EXPECT_TENSOR_CLOSE(out, expected, 1e-5, 1e-6);
    EXPECT_TENSOR_EQ(k_cache, k_ref);
    EXPECT_TENSOR_EQ(v_cache, v_ref);
  }
}

// A row's result is its own: decoded alone it is the same bit for bit (no batch-dependent blocking or reduction).
// Training, other dtypes and several tokens keep the formula.
TEST(CpuKernels, DecodeAttentionOfARowAloneEqualsItInABatchBitForBit) {
  c10::NoGradGuard no_grad;
  at::Generator gen = make_gen(42);
  const at::Tensor q = randn({6, 1, 8, 64}, gen).transpose(1, 2), k = randn({6, 1, 2, 64}, gen).transpose(1, 2);
  const at::Tensor v = randn({6, 1, 2, 64}, gen).transpose(1, 2);
  at::Tensor k_cache = randn({6, 2, 50, 64}, gen), v_cache = randn({6, 2, 50, 64}, gen);
  const at::Tensor rows = at::arange(6, at::kLong), positions = at::randint(50, {6}, gen, at::kLong);
  const at::Tensor whole = decode_attention_cpu(q, k, v, k_cache, v_cache, rows, positions, 50, 0.125);
  for (int64_t b = 0; b < 6; ++b) {
    const at::Tensor alone = decode_attention_cpu(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1), k_cache,
                                                  v_cache, rows.narrow(0, b, 1), positions.narrow(0, b, 1), 50, 0.125);
    EXPECT_TENSOR_EQ(alone, whole.narrow(0, b, 1));
  }
  EXPECT_FALSE(decode_attention_cpu_applies(q.to(at::kDouble), k_cache.to(at::kDouble), v_cache.to(at::kDouble)));
  EXPECT_FALSE(decode_attention_cpu_applies(randn({6, 8, 2, 64}, gen), k_cache, v_cache));  // two tokens: a prefill
  c10::AutoGradMode training(true);
  EXPECT_FALSE(decode_attention_cpu_applies(q, k_cache, v_cache));
}

}  // namespace
}  // namespace skyrl_tx::ops
