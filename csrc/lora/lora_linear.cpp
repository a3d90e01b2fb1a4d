// LoraLinear: a frozen base linear layer plus stacked per-slot LoRA factors, applied per token segment.
#include "lora/lora_linear.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cmath>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::lora {

LoraLinear::LoraLinear(at::Tensor weight, at::Tensor bias, int64_t num_slots, int64_t max_rank)
    : weight_(std::move(weight)),
      bias_(std::move(bias)),
      a_t_(num_slots),
      b_t_(num_slots),
      ranks_(num_slots, 0),
      scalings_(num_slots, 0.0),
      grad_a_(num_slots),
      grad_b_(num_slots) {
  SKYRL_TX_INTERNAL_ASSERT(weight_.dim() == 2, "weight must be [out, in]");
  auto opts = weight_.options().dtype(at::kFloat);
  a_ = at::zeros({num_slots, max_rank, in_features()}, opts).requires_grad_(true);
  // [out, S, R]: viewed as [out, S * R] it is every slot's B side by side (the row-dense path's one matmul).
  b_ = at::zeros({out_features(), num_slots, max_rank}, opts).requires_grad_(true);
  column_scaling_ = at::zeros({num_slots * max_rank}, opts);
}

namespace {

// One adapter segment with LoRA enabled, flattened into the integers an autograd node can store.
constexpr int64_t kSegmentFields = 4;  // slot, begin, length, rank

at::Tensor slot_a(const at::Tensor& a, int64_t slot, int64_t rank, at::ScalarType dtype) {
  return a.select(0, slot).narrow(0, 0, rank).to(dtype);  // [rank, in]
}

at::Tensor slot_b(const at::Tensor& b, int64_t slot, int64_t rank, at::ScalarType dtype) {
  return b.select(1, slot).narrow(1, 0, rank).to(dtype);  // [out, rank]
}

// [N, in]: the base product's input gradient grad W, or zeros when the node computed the adapters' update alone.
at::Tensor base_input_grad(const at::Tensor& grad, const at::Tensor& weight, bool with_base) {
  return with_base ? at::mm(grad, weight.to(grad.scalar_type()))
                   : at::zeros({grad.size(0), weight.size(1)}, grad.options());
}

// y = x W^T + b + sum_s scaling_s (x_s A_s^T) B_s^T in one autograd node (W and b frozen). The LoRA update
// is accumulated into y in place (no per-segment delta, concat or scale pass), and the backward adds each
// adapter's factor gradients straight into that slot's own accumulator (no [S, ...] gradient of the whole
// stack): the ATen twin of a segmented-gather LoRA kernel (Punica SGMV, Chen et al. 2023).
class LoraFunction : public torch::autograd::Function<LoraFunction> {
 public:
  // NOTE: the frozen weight and bias come through `base`, not as autograd inputs (an undefined bias cannot be one).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& a,
                            const at::Tensor& b, const LoraLinear* base, const std::vector<int64_t>& segments,
                            const std::vector<double>& scalings, bool with_base) {
    // with_base false: the adapters' update alone (the base product ran elsewhere, e.g. a grouped expert GEMM).
    at::Tensor y = with_base ? at::linear(x, base->weight(), base->bias())
                             : at::zeros({x.size(0), base->out_features()}, x.options());  // [N, out]
    std::vector<at::Tensor> saved{x, a, b, base->weight()};
    for (size_t i = 0; i < scalings.size(); ++i) {
      const int64_t* s = &segments[i * kSegmentFields];
      at::Tensor xa = at::mm(x.narrow(0, s[1], s[2]), slot_a(a, s[0], s[3], x.scalar_type()).t());  // [n, rank]
      y.narrow(0, s[1], s[2]).addmm_(xa, slot_b(b, s[0], s[3], x.scalar_type()).t(), 1.0, scalings[i]);
      saved.push_back(xa);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["segments"] = segments;
    ctx->saved_data["scalings"] = scalings;
    ctx->saved_data["with_base"] = with_base;
    // The module outlives the graph (the model owns it); the backward writes into its per-slot gradients.
    ctx->saved_data["module"] = reinterpret_cast<int64_t>(base);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &a = saved[1], &b = saved[2], &weight = saved[3];
    const std::vector<int64_t> segments = ctx->saved_data["segments"].toIntVector();
    const std::vector<double> scalings = ctx->saved_data["scalings"].toDoubleVector();
    const at::Tensor& grad = grads[0];  // [N, out]
    const auto* module = reinterpret_cast<const LoraLinear*>(ctx->saved_data["module"].toInt());
    const bool need_x = ctx->needs_input_grad(0), need_a = ctx->needs_input_grad(1), need_b = ctx->needs_input_grad(2);
    at::Tensor grad_x = need_x ? base_input_grad(grad, weight, ctx->saved_data["with_base"].toBool()) : at::Tensor();
    for (size_t i = 0; i < scalings.size(); ++i) {
      const int64_t slot = segments[i * kSegmentFields], begin = segments[i * kSegmentFields + 1];
      const int64_t length = segments[i * kSegmentFields + 2], rank = segments[i * kSegmentFields + 3];
      const double scaling = scalings[i];
      at::Tensor g = grad.narrow(0, begin, length);  // [n, out]
      const at::Tensor& xa = saved[4 + i];            // [n, rank]
      // NOTE: a slot may own several segments (unsorted rows), so its gradients accumulate.
      if (need_b) module->slot_grad_b(slot).narrow(1, 0, rank).add_(at::mm(g.t(), xa), scaling);
      if (!need_a && !need_x) continue;
      at::Tensor g_xa = at::mm(g, slot_b(b, slot, rank, g.scalar_type()));  // [n, rank], before scaling
      if (need_a) module->slot_grad_a(slot).narrow(0, 0, rank).add_(at::mm(g_xa.t(), x.narrow(0, begin, length)), scaling);
      if (need_x) grad_x.narrow(0, begin, length).addmm_(g_xa, slot_a(a, slot, rank, g.scalar_type()), 1.0, scaling);
    }
    // The factor gradients went to the module's per-slot accumulators: autograd gets none for the stacks.
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Many adapters in one batch: every slot's factors in one matmul per direction, each row masked to its own
// slot (and scaled), instead of ~12 small kernels per adapter segment. The batched twin of LoraFunction;
// gradients again go straight into the trained slots' own accumulators.
class RowDenseLoraFunction : public torch::autograd::Function<RowDenseLoraFunction> {
 public:
  // slot_columns: [N, S * R] float, 1 on the columns of the row's slot (one tensor shared by every layer).
  // slots: the LoRA-enabled slots present in the batch, with their ranks ({slot, rank} pairs, flattened).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& a,
                            const at::Tensor& b, const LoraLinear* base, const at::Tensor& slot_columns,
                            const std::vector<int64_t>& slots, bool with_base) {
    const int64_t columns = a.size(0) * a.size(1);
    at::Tensor a_all = a.view({columns, a.size(2)}).to(x.scalar_type());  // [S * R, in]
    at::Tensor b_all = b.view({b.size(0), columns}).to(x.scalar_type());  // [out, S * R]
    // Float32 mask (row's slot's scaling on its first rank columns, else 0): the scaling is never rounded.
    at::Tensor xa = at::mm(x, a_all.t()).mul_(slot_columns * base->column_scaling());  // [N, S * R], scaled
    at::Tensor y = with_base ? at::linear(x, base->weight(), base->bias())
                             : at::zeros({x.size(0), base->out_features()}, x.options());  // [N, out]
    y.addmm_(xa, b_all.t());
    ctx->save_for_backward({x, slot_columns, xa, a_all, b_all, base->weight()});
    ctx->saved_data["slots"] = slots;
    ctx->saved_data["with_base"] = with_base;
    ctx->saved_data["max_rank"] = a.size(1);
    ctx->saved_data["module"] = reinterpret_cast<int64_t>(base);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &slot_columns = saved[1], &xa = saved[2], &a_all = saved[3], &b_all = saved[4];
    const at::Tensor& weight = saved[5];
    const std::vector<int64_t> slots = ctx->saved_data["slots"].toIntVector();
    const int64_t max_rank = ctx->saved_data["max_rank"].toInt();
    const auto* module = reinterpret_cast<const LoraLinear*>(ctx->saved_data["module"].toInt());
    const at::Tensor& grad = grads[0];  // [N, out]
    const bool need_x = ctx->needs_input_grad(0), need_a = ctx->needs_input_grad(1), need_b = ctx->needs_input_grad(2);
    at::Tensor grad_x = need_x ? base_input_grad(grad, weight, ctx->saved_data["with_base"].toBool()) : at::Tensor();
    if (need_b) {
      at::Tensor grad_b = at::mm(grad.t(), xa);  // [out, S * R]
      for (size_t i = 0; i < slots.size(); i += 2) {
        module->slot_grad_b(slots[i]).narrow(1, 0, slots[i + 1]).add_(grad_b.narrow(1, slots[i] * max_rank, slots[i + 1]));
      }
    }
    if (need_a || need_x) {
      at::Tensor g_xa = at::mm(grad, b_all).mul_(slot_columns * module->column_scaling());  // [N, S * R], scaled
      if (need_a) {
        at::Tensor grad_a = at::mm(g_xa.t(), x);  // [S * R, in]
        for (size_t i = 0; i < slots.size(); i += 2) {
          module->slot_grad_a(slots[i]).narrow(0, 0, slots[i + 1]).add_(grad_a.narrow(0, slots[i] * max_rank, slots[i + 1]));
        }
      }
      if (need_x) grad_x.addmm_(g_xa, a_all);
    }
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::atomic<RowDenseBatches> row_dense_batches{RowDenseBatches::kOnGpu};

}  // namespace

void LoraLinear::set_row_dense_batches(RowDenseBatches policy) { row_dense_batches = policy; }

bool LoraLinear::use_row_dense(const at::Tensor& x, int64_t lora_slots) {
  switch (row_dense_batches.load()) {
    case RowDenseBatches::kNever: return false;
    case RowDenseBatches::kAlways: return lora_slots >= 1;
    case RowDenseBatches::kOnGpu: return x.is_cuda() && lora_slots >= kRowDenseMinSlots;
  }
  return false;
}

at::Tensor LoraLinear::forward(const at::Tensor& x, const AdapterSegments& segments) const {
  return apply(x, segments, /*with_base=*/true);
}

at::Tensor LoraLinear::adapter_update(const at::Tensor& x, const AdapterSegments& segments) const {
  return apply(x, segments, /*with_base=*/false);
}

at::Tensor LoraLinear::apply(const at::Tensor& x, const AdapterSegments& segments, bool with_base) const {
  if (segments.row_dense()) return forward_row_dense(x, segments.slot_columns(), with_base);
  std::vector<int64_t> active;  // kSegmentFields per segment whose slot has LoRA here
  std::vector<double> scalings;
  std::vector<int64_t> lora_slots;  // {slot, rank} per distinct LoRA-enabled slot
  for (const Segment& s : segments.segments()) {
    if (ranks_[s.slot] == 0) continue;
    active.insert(active.end(), {s.slot, s.begin, s.length, ranks_[s.slot]});
    scalings.push_back(scalings_[s.slot]);
    bool seen = false;
    for (size_t i = 0; i < lora_slots.size(); i += 2) seen = seen || lora_slots[i] == s.slot;
    if (!seen) lora_slots.insert(lora_slots.end(), {s.slot, ranks_[s.slot]});
  }
  if (scalings.empty()) return with_base ? at::linear(x, weight_, bias_) : at::Tensor();  // [N, out]
  if (use_row_dense(x, static_cast<int64_t>(lora_slots.size()) / 2)) {
    const at::Tensor& slot_columns = segments.slot_columns_on(x.device(), a_.size(0), a_.size(1));  // [N, S * R]
    if (!c10::GradMode::is_enabled()) return forward_row_dense(x, slot_columns, with_base);
    return RowDenseLoraFunction::apply(x, a_, b_, this, slot_columns, lora_slots, with_base);
  }
  if (c10::GradMode::is_enabled()) {
    // NOTE: LoRA slots live only on the shared frozen base (full fine-tuning copies have slot 0 only).
    SKYRL_TX_INTERNAL_ASSERT(!weight_.requires_grad() && !(bias_.defined() && bias_.requires_grad()),
                             "LoRA on a trainable base weight is not supported");
    return LoraFunction::apply(x, a_, b_, this, active, scalings, with_base);
  }
  // Inference: the same update, in place on the base output.
  at::Tensor y = with_base ? at::linear(x, weight_, bias_) : at::zeros({x.size(0), out_features()}, x.options());
  const bool masters = x.scalar_type() == a_.scalar_type();  // multiply by the cached views, no cast
  for (size_t i = 0; i < scalings.size(); ++i) {
    const int64_t* s = &active[i * kSegmentFields];
    const bool all_rows = s[1] == 0 && s[2] == x.size(0);
    const at::Tensor a_t = masters ? a_t_[s[0]] : slot_a(a_, s[0], s[3], x.scalar_type()).t();  // [in, rank]
    const at::Tensor b_t = masters ? b_t_[s[0]] : slot_b(b_, s[0], s[3], x.scalar_type()).t();  // [rank, out]
    at::Tensor xa = at::mm(all_rows ? x : x.narrow(0, s[1], s[2]), a_t);  // [n, rank]
    (all_rows ? y : y.narrow(0, s[1], s[2])).addmm_(xa, b_t, 1.0, scalings[i]);
  }
  return y;
}

at::Tensor LoraLinear::forward_row_dense(const at::Tensor& x, const at::Tensor& slot_columns, bool with_base) const {
  SKYRL_TX_INTERNAL_ASSERT(!c10::GradMode::is_enabled(), "the row-dense LoRA path is inference only");
  prepare_inference(x.scalar_type());
  at::Tensor y = with_base ? at::linear(x, weight_, bias_)
                           : at::zeros({x.size(0), out_features()}, x.options());  // [N, out]
  // Every slot's A at once: xa[n, s * R + r] = A_s[r] . x_n; then keep only row n's own slot's columns (the
  // 0/1 mask is exact in any dtype; the scaling is already in b_scaled).
  at::Tensor xa = at::mm(x, inference_.a.t()).mul_(slot_columns);  // [N, S * R]
  return y.addmm_(xa, inference_.b_scaled.t());                    // [N, out]
}

void LoraLinear::move_weight_into(at::Tensor storage) {
  SKYRL_TX_INTERNAL_ASSERT(storage.sizes() == weight_.sizes() && storage.scalar_type() == weight_.scalar_type(),
                           "a base weight moves only into storage of its own shape and dtype");
  c10::NoGradGuard no_grad;
  storage.copy_(weight_);
  weight_ = std::move(storage);
}

void LoraLinear::prepare_inference(at::ScalarType dtype) const {
  c10::NoGradGuard no_grad;
  const int64_t columns = a_.size(0) * a_.size(1);
  const at::Tensor a_masters = a_.view({columns, in_features()});   // [S * R, in]
  const at::Tensor b_masters = b_.view({out_features(), columns});  // [out, S * R]
  const bool a_is_view = dtype == a_.scalar_type();                 // then always current
  if (!inference_.a.defined() || inference_.a.scalar_type() != dtype) {
    inference_ = InferenceFactors{};
    inference_.a = a_is_view ? a_masters : at::empty(a_masters.sizes(), a_.options().dtype(dtype));
    inference_.b_scaled = at::empty(b_masters.sizes(), b_.options().dtype(dtype));
  }
  if (!a_is_view && inference_.a_version != a_._version()) {
    inference_.a.copy_(a_masters);
    inference_.a_version = a_._version();
  }
  if (inference_.b_version != b_._version() || inference_.scaling_version != column_scaling_._version()) {
    inference_.b_scaled.copy_(b_masters * column_scaling_);  // scaled in float32, rounded once
    inference_.b_version = b_._version();
    inference_.scaling_version = column_scaling_._version();
  }
}

std::pair<at::Tensor, at::Tensor> LoraLinear::inference_factors(at::ScalarType dtype) const {
  prepare_inference(dtype);
  return {inference_.a, inference_.b_scaled};
}

void LoraLinear::set_slot_scaling(int64_t slot, int64_t rank, double scaling) {
  ranks_[slot] = rank;
  scalings_[slot] = scaling;
  {
    c10::NoGradGuard no_grad;
    a_t_[slot] = rank > 0 ? a_.select(0, slot).narrow(0, 0, rank).t() : at::Tensor();
    b_t_[slot] = rank > 0 ? b_.select(1, slot).narrow(1, 0, rank).t() : at::Tensor();
  }
  const int64_t max_rank = a_.size(1);
  at::Tensor columns = column_scaling_.narrow(0, slot * max_rank, max_rank);
  columns.zero_();
  if (rank > 0) columns.narrow(0, 0, rank).fill_(scaling);
}

void LoraLinear::enable_slot(int64_t slot, int64_t rank, double scaling, at::Generator generator, int64_t whole_in,
                             int64_t in_begin) {
  SKYRL_TX_INTERNAL_ASSERT(slot > 0 && slot < static_cast<int64_t>(ranks_.size()), "slot out of range");
  SKYRL_TX_INTERNAL_ASSERT(rank > 0 && rank <= a_.size(1), "rank out of range");
  if (whole_in == 0) whole_in = in_features();
  SKYRL_TX_INTERNAL_ASSERT(in_begin >= 0 && in_begin + in_features() <= whole_in, "shard outside the layer");
  c10::NoGradGuard no_grad;
  // kaiming_uniform_(a=sqrt(5)) on [rank, in] gives bound = 1 / sqrt(in) (PEFT, torch.nn.Linear init).
  const double bound = 1.0 / std::sqrt(static_cast<double>(whole_in));
  at::Tensor init = at::empty({rank, whole_in}, at::TensorOptions().dtype(at::kFloat));  // [rank, whole in]
  init.uniform_(-bound, bound, generator);
  a_.select(0, slot).zero_();
  b_.select(1, slot).zero_();
  a_.select(0, slot).narrow(0, 0, rank).copy_(init.narrow(1, in_begin, in_features()));
  set_slot_scaling(slot, rank, scaling);
}

void LoraLinear::load_slot(int64_t slot, int64_t rank, double scaling, const at::Tensor& a, const at::Tensor& b) {
  SKYRL_TX_INTERNAL_ASSERT(slot > 0 && slot < static_cast<int64_t>(ranks_.size()), "slot out of range");
  SKYRL_TX_INTERNAL_ASSERT(rank > 0 && rank <= a_.size(1), "rank out of range");
  c10::NoGradGuard no_grad;
  a_.select(0, slot).zero_();
  b_.select(1, slot).zero_();
  set_slot_scaling(slot, rank, scaling);
  set_factors(slot, a, b);
}

void LoraLinear::disable_slot(int64_t slot) {
  c10::NoGradGuard no_grad;
  a_.select(0, slot).zero_();
  b_.select(1, slot).zero_();
  grad_a_.at(slot) = at::Tensor();  // freed: the next tenant of the slot starts without gradients
  grad_b_.at(slot) = at::Tensor();
  set_slot_scaling(slot, 0, 0.0);
}

at::Tensor LoraLinear::lora_a(int64_t slot) const { return a_.select(0, slot).narrow(0, 0, ranks_.at(slot)); }

at::Tensor LoraLinear::lora_b(int64_t slot) const { return b_.select(1, slot).narrow(1, 0, ranks_.at(slot)); }

at::Tensor LoraLinear::lora_a_grad(int64_t slot) const {
  const at::Tensor& grad = grad_a_.at(slot);
  return grad.defined() ? grad.narrow(0, 0, ranks_.at(slot)) : at::Tensor();
}

at::Tensor LoraLinear::lora_b_grad(int64_t slot) const {
  const at::Tensor& grad = grad_b_.at(slot);
  return grad.defined() ? grad.narrow(1, 0, ranks_.at(slot)) : at::Tensor();
}

std::pair<at::Tensor, at::Tensor> LoraLinear::take_slot_grads(int64_t slot) {
  return {std::exchange(grad_a_.at(slot), at::Tensor()), std::exchange(grad_b_.at(slot), at::Tensor())};
}

void LoraLinear::put_slot_grads(int64_t slot, std::pair<at::Tensor, at::Tensor> grads) {
  grad_a_.at(slot) = std::move(grads.first);
  grad_b_.at(slot) = std::move(grads.second);
}

at::Tensor& LoraLinear::slot_grad_a(int64_t slot) const {
  at::Tensor& grad = grad_a_.at(slot);
  if (!grad.defined()) grad = at::zeros({a_.size(1), a_.size(2)}, a_.options());  // [max_rank, in]
  return grad;
}

at::Tensor& LoraLinear::slot_grad_b(int64_t slot) const {
  at::Tensor& grad = grad_b_.at(slot);
  if (!grad.defined()) grad = at::zeros({b_.size(0), b_.size(2)}, b_.options());  // [out, max_rank]
  return grad;
}

void LoraLinear::zero_slot_grad(int64_t slot) {
  // Kept allocated: the slot's next step accumulates into the same buffers.
  if (grad_a_.at(slot).defined()) grad_a_[slot].zero_();
  if (grad_b_.at(slot).defined()) grad_b_[slot].zero_();
}

void LoraLinear::set_factors(int64_t slot, const at::Tensor& a, const at::Tensor& b) {
  const int64_t rank = ranks_.at(slot);
  SKYRL_TX_CHECK(rank > 0, InvalidArgument, "set_adapter_weights: LoRA is not enabled on this module for the adapter");
  SKYRL_TX_CHECK(a.dim() == 2 && a.size(0) == rank && a.size(1) == in_features(), InvalidArgument,
                 "set_adapter_weights: lora_A must be [", rank, ", ", in_features(), "], got ", shape_str(a));
  SKYRL_TX_CHECK(b.dim() == 2 && b.size(0) == out_features() && b.size(1) == rank, InvalidArgument,
                 "set_adapter_weights: lora_B must be [", out_features(), ", ", rank, "], got ", shape_str(b));
  c10::NoGradGuard no_grad;
  lora_a(slot).copy_(a);
  lora_b(slot).copy_(b);
}

}  // namespace skyrl_tx::lora
