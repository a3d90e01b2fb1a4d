// chunk_gated_delta_rule_cpu: the chunked gated delta rule on float32 CPU tensors as one autograd Function with a
// hand-derived backward; models::chunk_gated_delta_rule_formula is its twin.
//
// q and k are l2-normalised (q also scaled by 1 / sqrt(Dk)) and repeated to the value heads; the sequence is padded
// to whole chunks. Per chunk (one batch row and head; C positions; cum = cumsum(g), the log decay from its start):
//   decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0            [C, C]
//   ut = (diag(beta) k k^T) * decay, used strictly below the diagonal; L = I + that
//   [U | W] = L^-1 [diag(beta) v | diag(beta exp(cum)) k]          the UT transform, for both at once
//   intra = (q k^T) * decay; q_decayed = diag(exp(cum)) q; k_to_end = diag(exp(cum_last - cum)) k
//   scan over chunks with the state S (S_0 = the initial state):
//     new_values = U - W S;   S' = exp(cum_last) S + k_to_end^T new_values
//   out = q_decayed S + intra new_values
// The backward is the chain rule through these lines, derived by hand (the comments name each term).
#include "ops/chunk_gated_delta_rule_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <cmath>
#include <vector>

#include "common/errors.h"
#include "ops/chunk_delta_cpu_kernels.h"
#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {
namespace {

using cpu_kernels::ChunkDims;

at::Tensor transposed(const at::Tensor& x) { return x.transpose(-1, -2); }

// [..., rows, cols] contiguous → [groups, rows, cols]: one matrix per (batch row, head, chunk), for bmm.
at::Tensor per_chunk(const at::Tensor& x) { return x.view({-1, x.size(-2), x.size(-1)}); }

// Runs loop(begin, end) over the chunks of every (batch row, head), one chunk per task.
template <typename Loop>
void over_chunks(int64_t groups, const Loop& loop) {
  at::parallel_for(0, groups, 1, loop);
}

// The loops' sizes, the same for the forward and the backward; q's scale is the formula's 1 / sqrt(key_dim).
ChunkDims chunk_dims(int64_t chunk, int64_t key_dim, int64_t value_dim, int64_t heads, int64_t chunks, int64_t tokens,
                     int64_t key_heads) {
  return {chunk, key_dim, value_dim, heads, chunks, tokens, heads / key_heads,
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(key_dim)))};
}

// Element strides (batch, token, head) of a raw [B, T, heads, D] or [B, T, heads] input.
void strides_of(const at::Tensor& x, int64_t (&out)[3]) {
  for (int d = 0; d < 3; ++d) out[d] = x.stride(d);
}

class ChunkGatedDeltaRuleFunction : public torch::autograd::Function<ChunkGatedDeltaRuleFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in,
                                                const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                                                const at::Tensor& beta_in, const at::Tensor& initial_state,
                                                int64_t chunk_size) {
    const int64_t batch = k_in.size(0), tokens = k_in.size(1), key_heads = k_in.size(2), key_dim = k_in.size(3);
    const int64_t heads = v_in.size(2), value_dim = v_in.size(3), C = chunk_size;
    const int64_t chunks = (tokens + C - 1) / C, groups = batch * heads * chunks;
    const ChunkDims dims = chunk_dims(C, key_dim, value_dim, heads, chunks, tokens, key_heads);
    const at::TensorOptions f32 = q_in.options();
    auto chunked = [&](int64_t width) {  // [B, H, n, C, width] (or [B, H, n, C] for width 0)
      std::vector<int64_t> shape{batch, heads, chunks, C};
      if (width > 0) shape.push_back(width);
      return at::empty(shape, f32);
    };
    const at::Tensor q = chunked(key_dim), k = chunked(key_dim), v = chunked(value_dim), beta = chunked(0);
    const at::Tensor inv_norm_q = chunked(0), inv_norm_k = chunked(0), cum = chunked(0), decay = chunked(C);
    const at::Tensor k_beta = chunked(key_dim), q_decayed = chunked(key_dim), k_to_end = chunked(key_dim);
    const at::Tensor rhs = chunked(value_dim + key_dim);
    cpu_kernels::ChunkRawInputs raw{q_in.const_data_ptr<float>(), k_in.const_data_ptr<float>(),
                                    v_in.const_data_ptr<float>(), g_in.const_data_ptr<float>(),
                                    beta_in.const_data_ptr<float>(), {}, {}, {}, {}, {}};
    strides_of(q_in, raw.q_stride);
    strides_of(k_in, raw.k_stride);
    strides_of(v_in, raw.v_stride);
    strides_of(g_in, raw.g_stride);
    strides_of(beta_in, raw.beta_stride);
    const cpu_kernels::ChunkPrepared prepared{q.data_ptr<float>(),          k.data_ptr<float>(),
                                              v.data_ptr<float>(),          beta.data_ptr<float>(),
                                              inv_norm_q.data_ptr<float>(), inv_norm_k.data_ptr<float>(),
                                              cum.data_ptr<float>(),        decay.data_ptr<float>(),
                                              k_beta.data_ptr<float>(),     rhs.data_ptr<float>(),
                                              q_decayed.data_ptr<float>(),  k_to_end.data_ptr<float>()};
    over_chunks(groups, [&](int64_t begin, int64_t end) {
      cpu_kernels::chunk_prepare(raw, prepared, dims, begin, end);
    });
    // [groups, C, C]: k_beta k^T and q k^T, then decayed in place, and the UT transform's (I + ut)^-1
    const at::Tensor ut = at::bmm(per_chunk(k_beta), transposed(per_chunk(k)));
    const at::Tensor intra = at::bmm(per_chunk(q), transposed(per_chunk(k)));
    const at::Tensor inverse = at::empty_like(ut);
    over_chunks(groups, [&](int64_t begin, int64_t end) {
      cpu_kernels::chunk_mask_and_invert(ut.data_ptr<float>(), intra.data_ptr<float>(), decay.const_data_ptr<float>(),
                                         inverse.data_ptr<float>(), dims, begin, end);
    });
    // [B, H, n, C, Dv + Dk]: U | W, both right-hand sides of the UT transform at once
    const at::Tensor solved = at::bmm(inverse, per_chunk(rhs)).view(rhs.sizes());
    const at::Tensor values = solved.narrow(-1, 0, value_dim), w = solved.narrow(-1, value_dim, key_dim);
    const at::Tensor chunk_decay = cum.select(-1, C - 1).exp().unsqueeze(-1).unsqueeze(-1);  // [B, H, n, 1, 1]

    at::Tensor states = at::empty({batch, heads, chunks, key_dim, value_dim}, f32);  // S entering chunk i
    at::Tensor new_values = chunked(value_dim);
    // The sequential scan, three ops per chunk on [B * H, ...] views: fresh = U - W S; S' = decay S; S' += k_to_end^T
    // fresh. Each S' is written where the next chunk reads it.
    at::Tensor state = at::empty({batch, heads, key_dim, value_dim}, f32);  // the final state
    states.select(2, 0).copy_(initial_state);
    for (int64_t i = 0; i < chunks; ++i) {
      const at::Tensor entering = states.select(2, i).view({-1, key_dim, value_dim});  // [B * H, Dk, Dv]
      at::Tensor fresh = new_values.select(2, i).view({-1, C, value_dim});            // [B * H, C, Dv]
      at::baddbmm_out(fresh, values.select(2, i).view({-1, C, value_dim}), w.select(2, i).view({-1, C, key_dim}),
                      entering, /*beta=*/1, /*alpha=*/-1);
      at::Tensor leaving = (i + 1 < chunks ? states.select(2, i + 1) : state).view({-1, key_dim, value_dim});
      at::mul_out(leaving, entering, chunk_decay.select(2, i).view({-1, 1, 1}));
      leaving.baddbmm_(transposed(k_to_end.select(2, i).view({-1, C, key_dim})), fresh);
    }
    // Both halves of the output at once over all chunks, then [B, H, n * C, Dv] → [B, T, H, Dv]
    const at::Tensor out = at::bmm(intra, per_chunk(new_values)).baddbmm_(per_chunk(q_decayed), per_chunk(states));
    ctx->save_for_backward({q, k, v, beta, inv_norm_q, inv_norm_k, cum, decay, ut, intra, inverse, solved,
                            new_values, states, k_beta, q_decayed, k_to_end});
    ctx->saved_data["tokens"] = tokens;
    ctx->saved_data["key_heads"] = key_heads;
    return {out.view({batch, heads, chunks * C, value_dim}).narrow(2, 0, tokens).transpose(1, 2).contiguous(), state};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_FUNCTION("skyrl_tx::chunk_gated_delta_rule_cpu_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &beta = saved[3], &inv_norm_q = saved[4];
    const at::Tensor &inv_norm_k = saved[5], &cum = saved[6], &decay = saved[7], &ut = saved[8], &intra = saved[9];
    const at::Tensor &inverse = saved[10], &solved = saved[11], &new_values = saved[12], &states = saved[13];
    const at::Tensor &k_beta = saved[14], &q_decayed = saved[15], &k_to_end = saved[16];
    const int64_t tokens = ctx->saved_data["tokens"].toInt(), key_heads = ctx->saved_data["key_heads"].toInt();
    const int64_t batch = q.size(0), heads = q.size(1), chunks = q.size(2), C = q.size(3);
    const int64_t key_dim = q.size(4), value_dim = v.size(4), groups = batch * heads * chunks;
    const ChunkDims dims = chunk_dims(C, key_dim, value_dim, heads, chunks, tokens, key_heads);
    at::Tensor grad_out = at::zeros_like(new_values);  // [B, H, n, C, Dv]; zero past the real tokens
    if (grads[0].defined()) {
      grad_out.view({batch, heads, chunks * C, value_dim}).narrow(2, 0, tokens).copy_(grads[0].transpose(1, 2));
    }
    const at::Tensor chunk_decay = cum.select(-1, C - 1).exp().unsqueeze(-1).unsqueeze(-1);  // [B, H, n, 1, 1]
    const at::Tensor w = solved.narrow(-1, value_dim, key_dim);
    // out = q_decayed S + intra new_values: the terms that do not wait for the state gradient, all chunks at once.
    const at::Tensor d_out = per_chunk(grad_out);                                           // [groups, C, Dv]
    at::Tensor grad_intra = at::bmm(d_out, transposed(per_chunk(new_values)));              // [groups, C, C]
    const at::Tensor grad_q_decayed = at::bmm(d_out, transposed(per_chunk(states)));        // [groups, C, Dk]
    const at::Tensor grad_values = at::bmm(transposed(intra), d_out).view(new_values.sizes());  // [B, H, n, C, Dv]
    const at::Tensor grad_state_from_out = at::bmm(transposed(per_chunk(q_decayed)), d_out).view(states.sizes());

    // The reverse scan, on [B * H, ...] views: grad_next[i] is the gradient at the state leaving chunk i (the final
    // state's, for the last), and each step writes the one leaving chunk i - 1 (or grad_state, the initial state's).
    at::Tensor grad_next = at::empty_like(states);  // [B, H, n, Dk, Dv]
    at::Tensor grad_state = at::empty({batch, heads, key_dim, value_dim}, q.options());
    if (grads[1].defined()) {
      grad_next.select(2, chunks - 1).copy_(grads[1]);
    } else {
      grad_next.select(2, chunks - 1).zero_();
    }
    for (int64_t i = chunks - 1; i >= 0; --i) {
      const at::Tensor leaving = grad_next.select(2, i).view({-1, key_dim, value_dim});
      at::Tensor grad_fresh = grad_values.select(2, i).view({-1, C, value_dim});
      grad_fresh.baddbmm_(k_to_end.select(2, i).view({-1, C, key_dim}), leaving);  // S' = decay S + k_to_end^T fresh
      at::Tensor entering = (i > 0 ? grad_next.select(2, i - 1) : grad_state).view({-1, key_dim, value_dim});
      at::mul_out(entering, leaving, chunk_decay.select(2, i).view({-1, 1, 1}));
      entering.add_(grad_state_from_out.select(2, i).view({-1, key_dim, value_dim}));  // out's q_decayed S
      entering.baddbmm_(transposed(w.select(2, i).view({-1, C, key_dim})), grad_fresh, /*beta=*/1, /*alpha=*/-1);
    }
    const at::Tensor grad_k_to_end = at::bmm(per_chunk(new_values), transposed(per_chunk(grad_next)));
    const at::Tensor grad_chunk_decay = (grad_next * states).sum({-1, -2});                // [B, H, n]
    const at::Tensor grad_w = at::bmm(per_chunk(grad_values), transposed(per_chunk(states))).neg_();

    // [U | W] = T rhs with T = (I + ut)^-1: rhs gets T^T [dU | dW]; ut's strictly lower part gets
    // -(T^T [dU | dW]) [U | W]^T (negated and masked by chunk_decay_grads).
    const at::Tensor grad_rhs =
        at::bmm(transposed(inverse), at::cat({per_chunk(grad_values), grad_w}, -1));  // [groups, C, Dv + Dk]
    at::Tensor grad_ut = at::bmm(grad_rhs, transposed(per_chunk(solved)));             // [groups, C, C]
    at::Tensor grad_cum = at::empty_like(cum);
    over_chunks(groups, [&](int64_t begin, int64_t end) {
      cpu_kernels::chunk_decay_grads(grad_ut.data_ptr<float>(), grad_intra.data_ptr<float>(),
                                     ut.const_data_ptr<float>(), intra.const_data_ptr<float>(),
                                     decay.const_data_ptr<float>(), grad_cum.data_ptr<float>(), dims, begin, end);
    });
    // grad_ut, grad_intra are now the gradients at k_beta k^T and q k^T: their matmul terms.
    const at::Tensor q3 = per_chunk(q), k3 = per_chunk(k);
    const at::Tensor gemm_k_beta = at::bmm(grad_ut, k3);                                         // [groups, C, Dk]
    const at::Tensor gemm_k = at::bmm(transposed(grad_ut), per_chunk(k_beta)).baddbmm_(transposed(grad_intra), q3);
    const at::Tensor gemm_q = at::bmm(grad_intra, k3);
    // The gradients at the chunk-layout inputs, then back through the gather (norms, head repeat, padding).
    const at::Tensor grad_q_chunks = at::empty_like(q), grad_k_chunks = at::empty_like(k);
    const at::Tensor grad_v_chunks = at::empty_like(v), grad_g_chunks = at::empty_like(cum);
    const at::Tensor grad_beta_chunks = at::empty_like(beta);
    const cpu_kernels::ChunkGradInputs in{q.const_data_ptr<float>(),
                                          k.const_data_ptr<float>(),
                                          v.const_data_ptr<float>(),
                                          beta.const_data_ptr<float>(),
                                          cum.const_data_ptr<float>(),
                                          k_beta.const_data_ptr<float>(),
                                          q_decayed.const_data_ptr<float>(),
                                          k_to_end.const_data_ptr<float>(),
                                          grad_rhs.const_data_ptr<float>(),
                                          grad_q_decayed.const_data_ptr<float>(),
                                          grad_k_to_end.const_data_ptr<float>(),
                                          gemm_k_beta.const_data_ptr<float>(),
                                          gemm_k.const_data_ptr<float>(),
                                          gemm_q.const_data_ptr<float>(),
                                          grad_chunk_decay.const_data_ptr<float>()};
    over_chunks(groups, [&](int64_t begin, int64_t end) {
      cpu_kernels::chunk_input_grads(in, grad_cum.data_ptr<float>(), grad_q_chunks.data_ptr<float>(),
                                     grad_k_chunks.data_ptr<float>(), grad_v_chunks.data_ptr<float>(),
                                     grad_g_chunks.data_ptr<float>(), grad_beta_chunks.data_ptr<float>(), dims, begin,
                                     end);
    });
    const at::TensorOptions f32 = q.options();
    at::Tensor grad_q = at::empty({batch, tokens, key_heads, key_dim}, f32), grad_k = at::empty_like(grad_q);
    at::Tensor grad_v = at::empty({batch, tokens, heads, value_dim}, f32);
    at::Tensor grad_g = at::empty({batch, tokens, heads}, f32), grad_beta = at::empty_like(grad_g);
    const cpu_kernels::ChunkScatter scatter{q.const_data_ptr<float>(),
                                            k.const_data_ptr<float>(),
                                            inv_norm_q.const_data_ptr<float>(),
                                            inv_norm_k.const_data_ptr<float>(),
                                            grad_q_chunks.const_data_ptr<float>(),
                                            grad_k_chunks.const_data_ptr<float>(),
                                            grad_v_chunks.const_data_ptr<float>(),
                                            grad_g_chunks.const_data_ptr<float>(),
                                            grad_beta_chunks.const_data_ptr<float>()};
    at::parallel_for(0, batch * tokens, 16, [&](int64_t begin, int64_t end) {
      cpu_kernels::chunk_scatter_grads(scatter, grad_q.data_ptr<float>(), grad_k.data_ptr<float>(),
                                       grad_v.data_ptr<float>(), grad_g.data_ptr<float>(), grad_beta.data_ptr<float>(),
                                       dims, begin, end);
    });
    return {grad_q, grad_k, grad_v, grad_g, grad_beta, grad_state, at::Tensor()};
  }
};

}  // namespace

bool chunk_gated_delta_rule_cpu_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& g, const at::Tensor& beta) {
  if (!cpu_vector_kernels_supported()) return false;
  for (const at::Tensor* x : {&q, &k, &v, &g, &beta}) {
    if (!x->is_cpu() || x->scalar_type() != at::kFloat) return false;
  }
  return q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && g.dim() == 3 && beta.dim() == 3 &&
         q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1;
}

std::pair<at::Tensor, at::Tensor> chunk_gated_delta_rule_cpu(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& g,
                                                             const at::Tensor& beta, int64_t chunk_size,
                                                             const at::Tensor& initial_state) {
  RECORD_FUNCTION("skyrl_tx::chunk_gated_delta_rule_cpu", std::vector<c10::IValue>());  // named in profiles
  const int64_t batch = k.size(0), tokens = k.size(1), heads = v.size(2);
  SKYRL_TX_INTERNAL_ASSERT(heads % k.size(2) == 0 && v.size(0) == batch && v.size(1) == tokens &&
                               g.sizes() == v.sizes().slice(0, 3) && beta.sizes() == g.sizes() && tokens > 0,
                           "chunk_gated_delta_rule_cpu: mismatched q ", q.sizes(), ", k ", k.sizes(), ", v ",
                           v.sizes(), ", g ", g.sizes(), ", beta ", beta.sizes());
  // autograd::Function takes defined tensors only: no initial state is a zero one (whose gradient goes nowhere).
  const at::Tensor state = initial_state.defined() ? initial_state
                                                   : at::zeros({batch, heads, k.size(3), v.size(3)}, v.options());
  auto results = ChunkGatedDeltaRuleFunction::apply(q, k, v, g, beta, state, chunk_size);
  return {results[0], results[1]};
}

}  // namespace skyrl_tx::ops
