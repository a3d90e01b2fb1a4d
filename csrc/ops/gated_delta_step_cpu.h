// gated_delta_step_cpu: one decode step of the gated delta rule on float32 CPU states in one pass per (row, head);
// models::recurrent_gated_delta_step (transformers' torch_recurrent_gated_delta_rule, T = 1) is its twin and oracle.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// Whether gated_delta_step_cpu applies: a float32 CPU state [B, heads, key_dim, value_dim] whose per-head matrices
/// are contiguous (it is updated in place), no autograd (decode runs without gradients), on a CPU that runs the loops
/// (cpu_vector_kernels_supported). The other inputs may be of any float dtype and layout.
bool gated_delta_step_cpu_applies(const at::Tensor& state);

/// The recurrent_gated_delta_step it replaces, same arguments and result: q, k [B, 1, key_heads, key_dim]; v
/// [B, 1, heads, value_dim]; g (log decay), beta [B, 1, heads]; state [B, heads, key_dim, value_dim] float32, updated
/// in place. Returns out [B, 1, heads, value_dim] in q's dtype. Where the formula makes a dozen [B, heads, key_dim,
/// value_dim] temporaries (decay, S * k, the rank-1 update, S * q), this reads and writes each head's state once.
at::Tensor gated_delta_step_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, at::Tensor& state);

}  // namespace skyrl_tx::ops
