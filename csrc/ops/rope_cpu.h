// rope_cpu: rotate-half RoPE of float32 CPU q/k in one pass forward and one backward; RotaryEmbedding::apply's ATen
// formula is its twin.
#pragma once

#include <ATen/ATen.h>

namespace skyrl_tx::ops {

/// Whether rope_cpu applies: float32 CPU x [B, heads, T, D] of any layout (even D) with float32 CPU cos/sin
/// [B or 1, T, D] of one shape, on a CPU that runs the loops (cpu_vector_kernels_supported). Decided by dtype,
/// device and shapes only, never by layout, so a token gets the same arithmetic in a prefill and a one-token step.
bool rope_cpu_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

/// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (cos/sin broadcast over heads), as the ATen formula
/// rounds it, without its temporaries (rotate_half's cat, two products): one read of x, one write. The result has
/// x's layout where x is dense (q/k arrive as [B, T, heads, D] memory seen as [B, heads, T, D]). Autograd gives x's
/// gradient in one pass, from cos/sin alone (no x is kept); cos/sin get none (they come from positions).
at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace skyrl_tx::ops
