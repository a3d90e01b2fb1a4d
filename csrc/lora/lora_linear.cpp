// LoraLinear: a frozen base linear layer plus stacked per-slot LoRA factors, applied per token segment.
#include "lora/lora_linear.h"

#include <c10/core/GradMode.h>

#include <cmath>

#include "common/dtype.h"
#include "common/errors.h"

namespace skyrl_tx::lora {

LoraLinear::LoraLinear(at::Tensor weight, at::Tensor bias, int64_t num_slots, int64_t max_rank)
    : weight_(std::move(weight)), bias_(std::move(bias)), ranks_(num_slots, 0), scalings_(num_slots, 0.0) {
  SKYRL_TX_INTERNAL_ASSERT(weight_.dim() == 2, "weight must be [out, in]");
  auto opts = weight_.options().dtype(at::kFloat);
  a_ = at::zeros({num_slots, max_rank, in_features()}, opts).requires_grad_(true);
  b_ = at::zeros({num_slots, out_features(), max_rank}, opts).requires_grad_(true);
}

at::Tensor LoraLinear::forward(const at::Tensor& x, const AdapterSegments& segments) const {
  at::Tensor y = at::linear(x, weight_, bias_);  // [N, out]
  bool any_lora = false;
  for (const Segment& s : segments.segments()) any_lora = any_lora || ranks_[s.slot] > 0;
  if (!any_lora) return y;

  // One small matmul pair per adapter segment; segments without LoRA contribute zeros.
  std::vector<at::Tensor> deltas;
  deltas.reserve(segments.segments().size());
  for (const Segment& s : segments.segments()) {
    const int64_t rank = ranks_[s.slot];
    if (rank == 0) {
      deltas.push_back(at::zeros({s.length, out_features()}, y.options()));
      continue;
    }
    at::Tensor xs = x.narrow(0, s.begin, s.length);                // [n, in]
    at::Tensor a = a_.select(0, s.slot).narrow(0, 0, rank);        // [rank, in]
    at::Tensor b = b_.select(0, s.slot).narrow(1, 0, rank);        // [out, rank]
    at::Tensor delta = at::linear(at::linear(xs, a.to(xs.scalar_type())), b.to(xs.scalar_type()));  // [n, out]
    deltas.push_back(delta * scalings_[s.slot]);
  }
  return y + at::cat(deltas, 0);
}

void LoraLinear::enable_slot(int64_t slot, int64_t rank, double scaling, at::Generator generator) {
  SKYRL_TX_INTERNAL_ASSERT(slot > 0 && slot < static_cast<int64_t>(ranks_.size()), "slot out of range");
  SKYRL_TX_INTERNAL_ASSERT(rank > 0 && rank <= a_.size(1), "rank out of range");
  c10::NoGradGuard no_grad;
  // kaiming_uniform_(a=sqrt(5)) on [rank, in] gives bound = 1 / sqrt(in) (PEFT, torch.nn.Linear init).
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features()));
  at::Tensor init = at::empty({rank, in_features()}, at::TensorOptions().dtype(at::kFloat));
  init.uniform_(-bound, bound, generator);
  a_.select(0, slot).zero_();
  b_.select(0, slot).zero_();
  a_.select(0, slot).narrow(0, 0, rank).copy_(init);
  ranks_[slot] = rank;
  scalings_[slot] = scaling;
}

void LoraLinear::load_slot(int64_t slot, int64_t rank, double scaling, const at::Tensor& a, const at::Tensor& b) {
  SKYRL_TX_INTERNAL_ASSERT(slot > 0 && slot < static_cast<int64_t>(ranks_.size()), "slot out of range");
  SKYRL_TX_INTERNAL_ASSERT(rank > 0 && rank <= a_.size(1), "rank out of range");
  c10::NoGradGuard no_grad;
  a_.select(0, slot).zero_();
  b_.select(0, slot).zero_();
  ranks_[slot] = rank;
  scalings_[slot] = scaling;
  set_factors(slot, a, b);
}

void LoraLinear::disable_slot(int64_t slot) {
  c10::NoGradGuard no_grad;
  a_.select(0, slot).zero_();
  b_.select(0, slot).zero_();
  zero_slot_grad(slot);
  ranks_[slot] = 0;
  scalings_[slot] = 0.0;
}

at::Tensor LoraLinear::lora_a(int64_t slot) const { return a_.select(0, slot).narrow(0, 0, ranks_.at(slot)); }

at::Tensor LoraLinear::lora_b(int64_t slot) const { return b_.select(0, slot).narrow(1, 0, ranks_.at(slot)); }

at::Tensor LoraLinear::lora_a_grad(int64_t slot) const {
  if (!a_.grad().defined()) return at::Tensor();
  return a_.grad().select(0, slot).narrow(0, 0, ranks_.at(slot));
}

at::Tensor LoraLinear::lora_b_grad(int64_t slot) const {
  if (!b_.grad().defined()) return at::Tensor();
  return b_.grad().select(0, slot).narrow(1, 0, ranks_.at(slot));
}

void LoraLinear::zero_slot_grad(int64_t slot) {
  c10::NoGradGuard no_grad;
  if (a_.grad().defined()) a_.mutable_grad().select(0, slot).zero_();
  if (b_.grad().defined()) b_.mutable_grad().select(0, slot).zero_();
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
