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

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <limits>
#include <vector>

#include "common/errors.h"
#include "ops/cpu_vector_kernels.h"

namespace skyrl_tx::ops {
namespace {

at::Tensor transposed(const at::Tensor& x) { return x.transpose(-1, -2); }

// exp(cum_i - cum_j) below and on the diagonal, 0 above: [B, H, n, C, C].
at::Tensor decay_matrix(const at::Tensor& cum) {
  const int64_t C = cum.size(-1);
  const at::Tensor above = at::ones({C, C}, cum.options().dtype(at::kBool)).triu(1);
  return (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(above, -std::numeric_limits<float>::infinity()).exp_();
}

class ChunkDeltaRuleFunction : public torch::autograd::Function<ChunkDeltaRuleFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                                const at::Tensor& beta, const at::Tensor& initial_state) {
    const int64_t batch = q.size(0), heads = q.size(1), chunks = q.size(2), C = q.size(3);
    const int64_t key_dim = q.size(4), value_dim = v.size(4);
    const at::Tensor cum = g.cumsum(-1);                    // [B, H, n, C]
    const at::Tensor from_start = cum.exp().unsqueeze(-1);  // [B, H, n, C, 1]
    const at::Tensor decay = decay_matrix(cum);             // [B, H, n, C, C]
    const at::Tensor k_beta = k * beta.unsqueeze(-1);       // [B, H, n, C, Dk]
    const at::Tensor ut = at::matmul(k_beta, transposed(k)).mul_(decay);
    const at::Tensor intra = at::matmul(q, transposed(k)).mul_(decay);
    // [B, H, n, C, Dv + Dk]: U | W, both right-hand sides of the UT transform in one solve
    const at::Tensor solved = at::linalg_solve_triangular(
        ut, at::cat({v * beta.unsqueeze(-1), k_beta * from_start}, -1), /*upper=*/false, /*left=*/true,
        /*unitriangular=*/true);
    const at::Tensor values = solved.narrow(-1, 0, value_dim), w = solved.narrow(-1, value_dim, key_dim);
    const at::Tensor k_to_end = k * (cum.narrow(-1, C - 1, 1) - cum).exp().unsqueeze(-1);  // [B, H, n, C, Dk]
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
    // Both halves of the output at once over all chunks: [B, H, n, C, Dv]
    at::Tensor out = at::matmul(q * from_start, states).add_(at::matmul(intra, new_values));
    ctx->save_for_backward({q, k, v, beta, cum, decay, ut, intra, solved, new_values, states});
    return {out, state};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_FUNCTION("skyrl_tx::chunk_delta_rule_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &beta = saved[3], &cum = saved[4];
    const at::Tensor &decay = saved[5], &ut = saved[6], &intra = saved[7], &solved = saved[8];
    const at::Tensor &new_values = saved[9], &states = saved[10];
    const int64_t batch = q.size(0), heads = q.size(1), chunks = q.size(2), C = q.size(3);
    const int64_t key_dim = q.size(4), value_dim = v.size(4);
    const at::Tensor grad_out = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(new_values);
    const at::Tensor from_start = cum.exp().unsqueeze(-1);                                   // [B, H, n, C, 1]
    const at::Tensor to_end = (cum.narrow(-1, C - 1, 1) - cum).exp().unsqueeze(-1);          // [B, H, n, C, 1]
    const at::Tensor chunk_decay = cum.select(-1, C - 1).exp().unsqueeze(-1).unsqueeze(-1);  // [B, H, n, 1, 1]
    const at::Tensor q_decayed = q * from_start, k_to_end = k * to_end;
    const at::Tensor w = solved.narrow(-1, value_dim, key_dim);

    // out = q_decayed S + intra new_values: the terms that do not wait for the state gradient, all chunks at once.
    const at::Tensor grad_intra = at::matmul(grad_out, transposed(new_values));          // [B, H, n, C, C]
    const at::Tensor grad_q_decayed = at::matmul(grad_out, transposed(states));          // [B, H, n, C, Dk]
    at::Tensor grad_values = at::matmul(transposed(intra), grad_out);                    // [B, H, n, C, Dv]
    const at::Tensor grad_state_from_out = at::matmul(transposed(q_decayed), grad_out);  // [B, H, n, Dk, Dv]

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
    const at::Tensor grad_k_to_end = at::matmul(new_values, transposed(grad_next));  // [B, H, n, C, Dk]
    const at::Tensor grad_chunk_decay = (grad_next * states).sum({-1, -2});          // [B, H, n]
    const at::Tensor grad_w = at::matmul(grad_values, transposed(states)).neg_();    // [B, H, n, C, Dk]

    // [U | W] = L^-1 rhs: rhs gets L^-T [dU | dW]; L's strictly lower part gets -(L^-T [dU | dW]) [U | W]^T.
    const at::Tensor grad_rhs = at::linalg_solve_triangular(transposed(ut), at::cat({grad_values, grad_w}, -1),
                                                            /*upper=*/true, /*left=*/true, /*unitriangular=*/true);
    const at::Tensor grad_ut = at::matmul(grad_rhs, transposed(solved)).neg_().tril_(-1);  // [B, H, n, C, C]
    const at::Tensor grad_v_beta = grad_rhs.narrow(-1, 0, value_dim);
    const at::Tensor grad_w_rhs = grad_rhs.narrow(-1, value_dim, key_dim);  // of k_beta * from_start

    // ut = (k_beta k^T) * decay and intra = (q k^T) * decay: the products' gradients, and the decay's.
    const at::Tensor grad_kk = grad_ut * decay, grad_qk = grad_intra * decay;  // [B, H, n, C, C]
    const at::Tensor k_beta = k * beta.unsqueeze(-1);
    const at::Tensor grad_k_beta = at::matmul(grad_kk, k).add_(grad_w_rhs * from_start);
    at::Tensor grad_k = at::matmul(transposed(grad_kk), k_beta)
                            .add_(at::matmul(transposed(grad_qk), q))
                            .add_(grad_k_to_end * to_end)
                            .add_(grad_k_beta * beta.unsqueeze(-1));
    const at::Tensor grad_q = at::matmul(grad_qk, k).add_(grad_q_decayed * from_start);

    // d/dcum: decay[i, j] = exp(cum_i - cum_j) sends its term to i and takes it from j; the other exp(cum) factors
    // each send (their gradient * themselves) summed over their row.
    const at::Tensor through_decay = grad_ut * ut + grad_intra * intra;  // [B, H, n, C, C]
    const at::Tensor to_end_term = (grad_k_to_end * k_to_end).sum(-1);  // [B, H, n, C]
    at::Tensor grad_cum = through_decay.sum(-1) - through_decay.sum(-2) + (grad_q_decayed * q_decayed).sum(-1) +
                          (grad_w_rhs * k_beta * from_start).sum(-1) - to_end_term;
    grad_cum.select(-1, C - 1)
        .add_(to_end_term.sum(-1))
        .add_(grad_chunk_decay * chunk_decay.squeeze(-1).squeeze(-1));
    const at::Tensor grad_g = grad_cum.flip(-1).cumsum(-1).flip(-1);  // cum = cumsum(g)
    const at::Tensor grad_beta = (grad_k_beta * k).sum(-1) + (grad_v_beta * v).sum(-1);
    const at::Tensor grad_v = grad_v_beta * beta.unsqueeze(-1);
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
