// conv_step_cpu: one decode token of Gated DeltaNet's depthwise causal conv1d on float32 CPU states, in one pass;
// models::causal_conv_step (concatenate the window, shift the state, multiply, sum) is its twin and oracle.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// Whether conv_step_cpu applies: a float32 CPU state [B, C, kernel - 1] with contiguous rows of channels (it is
/// shifted in place) and a float32 weight [C, kernel], no autograd, and the fused CPU ops on
/// (cpu_vector_kernels_supported: SKYRL_TX_FUSED_CPU_OPS=0 turns this one off with the others).
bool conv_step_cpu_applies(const at::Tensor& state, const at::Tensor& weight);

/// causal_conv_step's arguments and result: x [B, C, 1] of any float dtype and layout; state [B, C, kernel - 1];
/// weight [C, kernel]. Returns float32 [B, C, 1]: each channel's window (state, then x) times its weights, summed in
/// window order, with the state shifted to end with x. The formula's window concatenation, state copy, product and
/// reduction over a 4-wide last dim are four strided passes; this is one.
at::Tensor conv_step_cpu(const at::Tensor& x, at::Tensor& state, const at::Tensor& weight);

}  // namespace skyrl_tx::ops
