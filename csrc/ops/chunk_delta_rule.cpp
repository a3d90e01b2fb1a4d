// chunk_delta_rule: the chunk-parallel core of the gated delta rule as one autograd Function with a hand-derived
// backward; models::chunk_delta_rule_formula is its twin.
//
// Per chunk (one batch row and head; C positions; cum = cumsum(g), the log decay from the chunk start):
//   decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0            [C, C]
//   ut = (diag(beta) k k^T) * decay, used strictly below the diagonal; L = I + that
//   [U | W] = L^-1 [diag(beta) v | diag(beta exp(cum)) k]          the UT transform, one solve for both
//   intra = (q k^T) * decay; q_decayed = diag(exp(cum)) q; k_to_end = diag(exp(cum_last - cum)) k
//   scan over chunks with the state S (S_0 = the initial state):
//     new_values = U - W S;   S' = exp(cum_last) S + k_to_end^T new_values
//   out = q_decayed S + intra new_values
// The backward is the chain rule through these lines, derived by hand (the comments name each term).
#include "ops/chunk_delta_rule.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

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

class ChunkDeltaRuleFunction : public torch::autograd::Function<ChunkDeltaRuleFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in,
                                                const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                                                const at::Tensor& beta_in, const at::Tensor& initial_state) {
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const at::Tensor g = g_in.contiguous(), beta = beta_in.contiguous();
    const int64_t batch = q.size(0), heads = q.size(1), chunks = q.size(2), C = q.size(3);
    const int64_t key_dim = q.size(4), value_dim = v.size(4), groups = batch * heads * chunks;
    const ChunkDims dims{C, key_dim, value_dim};
    const at::Tensor cum = at::empty_like(g);                                         // [B, H, n, C]
    const at::Tensor decay = at::empty({batch, heads, chunks, C, C}, q.options());    // exp(cum_i - cum_j), j <= i
    const at::Tensor k_beta = at::empty_like(k), q_decayed = at::empty_like(q), k_to_end = at::empty_like(k);
    const at::Tensor rhs = at::empty({batch, heads, chunks, C, value_dim + key_dim}, q.options());
    over_chunks(groups, [&](int64_t begin, int64_t end) {
      cpu_kernels::chunk_prepare(q.const_data_ptr<float>(), k.const_data_ptr<float>(), v.const_data_ptr<float>(),
                                 g.const_data_ptr<float>(), beta.const_data_ptr<float>(), cum.data_ptr<float>(),
                                 decay.data_ptr<float>(), k_beta.data_ptr<float>(), rhs.data_ptr<float>(),
                                 q_decayed.data_ptr<float>(), k_to_end.data_ptr<float>(), dims, begin, end);
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

    at::Tensor states = at::empty({batch, heads, chunks, key_dim, value_dim}, q.options());  // S entering chunk i
    at::Tensor new_values = at::empty({batch, heads, chunks, C, value_dim}, q.options());
    at::Tensor state = initial_state.to(at::kFloat);  // [B, H, Dk, Dv]
    for (int64_t i = 0; i < chunks; ++i) {  // the sequential scan: only what the next state needs
      states.select(2, i).copy_(state);
      at::Tensor fresh = new_values.select(2, i);  // [B, H, C, Dv]
      at::sub_out(fresh, values.select(2, i), at::matmul(w.select(2, i), state));
      state = state * chunk_decay.select(2, i) + at::matmul(transposed(k_to_end.select(2, i)), fresh);
    }
    // Both halves of the output at once over all chunks: [groups, C, Dv]
    at::Tensor out = at::bmm(intra, per_chunk(new_values)).baddbmm_(per_chunk(q_decayed), per_chunk(states));
    ctx->save_for_backward(
        {q, k, v, beta, cum, decay, ut, intra, inverse, solved, new_values, states, k_beta, q_decayed, k_to_end});
    return {out.view(new_values.sizes()), state};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_FUNCTION("skyrl_tx::chunk_delta_rule_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &beta = saved[3], &cum = saved[4];
    const at::Tensor &decay = saved[5], &ut = saved[6], &intra = saved[7], &inverse = saved[8], &solved = saved[9];
    const at::Tensor &new_values = saved[10], &states = saved[11], &k_beta = saved[12], &q_decayed = saved[13];
    const at::Tensor& k_to_end = saved[14];
    const int64_t batch = q.size(0), heads = q.size(1), chunks = q.size(2), C = q.size(3);
    const int64_t key_dim = q.size(4), value_dim = v.size(4), groups = batch * heads * chunks;
    const ChunkDims dims{C, key_dim, value_dim};
    const at::Tensor grad_out = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(new_values);
    const at::Tensor chunk_decay = cum.select(-1, C - 1).exp().unsqueeze(-1).unsqueeze(-1);  // [B, H, n, 1, 1]
    const at::Tensor w = solved.narrow(-1, value_dim, key_dim);

    // out = q_decayed S + intra new_values: the terms that do not wait for the state gradient, all chunks at once.
    const at::Tensor d_out = per_chunk(grad_out);                                           // [groups, C, Dv]
    at::Tensor grad_intra = at::bmm(d_out, transposed(per_chunk(new_values)));              // [groups, C, C]
    const at::Tensor grad_q_decayed = at::bmm(d_out, transposed(per_chunk(states)));        // [groups, C, Dk]
    const at::Tensor grad_values = at::bmm(transposed(intra), d_out).view(new_values.sizes());  // [B, H, n, C, Dv]
    const at::Tensor grad_state_from_out = at::bmm(transposed(per_chunk(q_decayed)), d_out).view(states.sizes());

    // The reverse scan. grad_state is the gradient at the state leaving chunk i (the final state's, for the last).
    at::Tensor grad_state = grads[1].defined() ? grads[1].to(at::kFloat).clone()
                                               : at::zeros({batch, heads, key_dim, value_dim}, q.options());
    at::Tensor grad_next = at::empty_like(states);  // [B, H, n, Dk, Dv]: grad_state leaving each chunk
    for (int64_t i = chunks - 1; i >= 0; --i) {
      grad_next.select(2, i).copy_(grad_state);
      at::Tensor grad_fresh = grad_values.select(2, i);  // S' = decay S + k_to_end^T fresh
      grad_fresh.add_(at::matmul(k_to_end.select(2, i), grad_state));
      // fresh = U - W S; out's q_decayed S; S' = decay S + ...
      grad_state = grad_state * chunk_decay.select(2, i) + grad_state_from_out.select(2, i) -
                   at::matmul(transposed(w.select(2, i)), grad_fresh);
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
    at::Tensor grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
    at::Tensor grad_g = at::empty_like(cum), grad_beta = at::empty_like(beta);
    const cpu_kernels::ChunkGradInputs in{
        q.const_data_ptr<float>(),           k.const_data_ptr<float>(),           v.const_data_ptr<float>(),
        beta.const_data_ptr<float>(),        cum.const_data_ptr<float>(),         k_beta.const_data_ptr<float>(),
        q_decayed.const_data_ptr<float>(),   k_to_end.const_data_ptr<float>(),    grad_rhs.const_data_ptr<float>(),
        grad_q_decayed.const_data_ptr<float>(), grad_k_to_end.const_data_ptr<float>(),
        gemm_k_beta.const_data_ptr<float>(), gemm_k.const_data_ptr<float>(),      gemm_q.const_data_ptr<float>(),
        grad_chunk_decay.const_data_ptr<float>()};
    over_chunks(groups, [&](int64_t begin, int64_t end) {
      cpu_kernels::chunk_input_grads(in, grad_cum.data_ptr<float>(), grad_q.data_ptr<float>(), grad_k.data_ptr<float>(),
                                     grad_v.data_ptr<float>(), grad_g.data_ptr<float>(), grad_beta.data_ptr<float>(),
                                     dims, begin, end);
    });
    return {grad_q, grad_k, grad_v, grad_g, grad_beta, grad_state};
  }
};

}  // namespace

bool chunk_delta_rule_applies(const at::Tensor& q) {
  return cpu_vector_kernels_supported() && q.is_cpu() && q.scalar_type() == at::kFloat;
}

std::pair<at::Tensor, at::Tensor> chunk_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& g, const at::Tensor& beta,
                                                   const at::Tensor& initial_state) {
  RECORD_FUNCTION("skyrl_tx::chunk_delta_rule", std::vector<c10::IValue>());  // named in profiles (gemm-share)
  SKYRL_TX_INTERNAL_ASSERT(q.dim() == 5 && k.sizes() == q.sizes() && v.dim() == 5 && v.sizes().slice(0, 4) ==
                               q.sizes().slice(0, 4) && g.sizes() == q.sizes().slice(0, 4) && beta.sizes() == g.sizes(),
                           "chunk_delta_rule: mismatched q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", g ",
                           g.sizes(), ", beta ", beta.sizes());
  // autograd::Function takes defined tensors only: no initial state is a zero one (whose gradient goes nowhere).
  const at::Tensor state = initial_state.defined()
                               ? initial_state
                               : at::zeros({q.size(0), q.size(1), q.size(4), v.size(4)}, q.options());
  auto results = ChunkDeltaRuleFunction::apply(q, k, v, g, beta, state);
  return {results[0], results[1]};
}

}  // namespace skyrl_tx::ops
