// Varlen attention over packed sequences: causal within each sequence of a packed row, never across them.
#include "models/packed_attention.h"

#ifdef SKYRL_TX_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <atomic>
#include <vector>

#include "common/errors.h"

namespace skyrl_tx::models {
namespace {

// Flash attention 2 (what ATen's _flash_attention_forward is) needs compute capability >= 8.0.
bool flash_capable_device(const at::Tensor& t) {
#ifdef SKYRL_TX_WITH_CUDA
  if (t.is_cuda()) return at::cuda::getDeviceProperties(t.device().index())->major >= 8;
#endif
  (void)t;
  return false;
}

// All sequences in one call: [N, heads, D] tensors and the cumulative starts (Dao 2023, FlashAttention-2 varlen).
// Flash takes grouped-query K/V as they are (kv_heads dividing heads); autograd runs _flash_attention_backward.
// Flash needs one head width: narrower values (MLA's) are zero-padded to it, and the padded output columns, zero
// anyway, are dropped (their gradient never reaches v: the pad's backward is a slice).
at::Tensor flash_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& layout,
                        double scale) {
  const int64_t width = q.size(-1), v_width = v.size(-1);
  at::Tensor qf = q.select(0, 0).transpose(0, 1).contiguous();  // [N, heads, D]
  at::Tensor kf = k.select(0, 0).transpose(0, 1).contiguous();  // [N, kv_heads, D]
  at::Tensor vf = v.select(0, 0).transpose(0, 1).contiguous();  // [N, kv_heads, Dv]
  if (v_width < width) vf = at::constant_pad_nd(vf, {0, width - v_width});  // [N, kv_heads, D]
  const int64_t max_len = layout.max_sequence_length;
  auto outputs = at::_flash_attention_forward(qf, kf, vf, layout.cu_seqlens, layout.cu_seqlens, max_len, max_len,
                                              /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false,
                                              scale);
  at::Tensor out = std::get<0>(outputs);  // [N, heads, D]
  if (v_width < width) out = out.narrow(-1, 0, v_width);
  return out.transpose(0, 1).unsqueeze(0);  // [1, heads, N, Dv]
}

// Set once a flash varlen call has failed for a reason other than memory (a libtorch built without flash
// attention, a kernel that refuses this GPU): every later packed batch takes the SDPA path, which computes the same.
std::atomic<bool> flash_varlen_refused{false};

}  // namespace

bool packed_attention_uses_flash(const at::Tensor& q, const at::Tensor& v) {
  const auto dtype = q.scalar_type();
  const int64_t d = q.size(-1);
  return (dtype == at::kHalf || dtype == at::kBFloat16) && v.size(-1) <= d && d % 8 == 0 && d <= 256 &&
         flash_capable_device(q) && !flash_varlen_refused.load();
}

at::Tensor packed_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const AttentionMask& layout, double scale) {
  SKYRL_TX_INTERNAL_ASSERT(layout.packed() && q.size(0) == 1, "packed attention takes one packed row");
  if (packed_attention_uses_flash(q, v)) {
    try {
      return flash_varlen(q, k, v, layout, scale);
    } catch (const c10::OutOfMemoryError&) {
      throw;  // the SDPA path needs memory too: the caller's error to report
    } catch (const c10::Error& e) {
      if (!flash_varlen_refused.exchange(true)) {
        TORCH_WARN("packed attention: flash attention's varlen kernel failed (", e.what_without_backtrace(),
                   "); packed sequences run one SDPA call per run of equal lengths from now on");
      }
    }
  }
  const bool gqa = q.size(1) != k.size(1);
  std::vector<at::Tensor> outs;  // per run: [1, heads, count * length, Dv]
  for (const SequenceRun& run : equal_length_runs(layout)) {
    // [1, H, count * len, D] → [count, H, len, D]: the run's sequences as a batch (a view of the row).
    auto as_batch = [&](const at::Tensor& t) {
      return t.narrow(2, run.begin, run.count * run.length)
          .unflatten(2, {run.count, run.length})
          .squeeze(0)
          .transpose(0, 1);
    };
    at::Tensor out = at::scaled_dot_product_attention(as_batch(q), as_batch(k), as_batch(v),
                                                      /*attn_mask=*/std::nullopt, 0.0, /*is_causal=*/true, scale,
                                                      gqa);  // [count, H, len, Dv]
    outs.push_back(out.transpose(0, 1).flatten(1, 2).unsqueeze(0));
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 2);
}

std::vector<SequenceRun> equal_length_runs(const AttentionMask& layout) {
  const std::vector<int64_t>& starts = layout.sequence_starts;
  std::vector<SequenceRun> runs;
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    if (!runs.empty() && runs.back().length == len) {
      ++runs.back().count;
    } else {
      runs.push_back({starts[s], 1, len});
    }
  }
  return runs;
}

}  // namespace skyrl_tx::models
