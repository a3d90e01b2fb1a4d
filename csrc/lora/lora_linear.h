// LoraLinear: a frozen base linear layer plus stacked per-slot LoRA factors, applied per token segment.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>
#include <vector>

#include "lora/adapter_segments.h"

namespace skyrl_tx::lora {

/// When a segmented batch takes the row-dense LoRA path (all slots in one matmul per direction, rows masked)
/// instead of per-segment matmuls: it trades (slots x max_rank) LoRA columns of FLOPs for far fewer kernels.
enum class RowDenseBatches {
  kOnGpu,   // CUDA tensors with >= kRowDenseMinSlots adapters in the batch (default: launches dominate there)
  kAlways,  // any device, any LoRA batch (tests compare both paths on a CPU)
  kNever,
};

/// y = x W^T (+ b) + scaling[slot] * B[slot] (A[slot] x)   (Hu et al. 2021, "LoRA", eq. 3)
/// NOTE: slot 0 is reserved for "no adapter": its rank stays 0 and its factors stay zero.
class LoraLinear {
 public:
  static constexpr int64_t kRowDenseMinSlots = 3;
  /// Process-wide policy (default kOnGpu).
  static void set_row_dense_batches(RowDenseBatches policy);

  /// weight: [out, in] in the compute dtype; bias: [out] or undefined. Factors are float32 masters.
  LoraLinear(at::Tensor weight, at::Tensor bias, int64_t num_slots, int64_t max_rank);

  /// x: [N, in] → [N, out]. Segments with slot 0, or a slot not enabled here, get the base output only.
  /// Row-dense segments (inference): each row's slot comes from a device tensor, no host-side segment loop.
  at::Tensor forward(const at::Tensor& x, const AdapterSegments& segments) const;
  /// The adapters' part of forward alone, scaling[slot] * B[slot] (A[slot] x) ([N, out]; rows of slot 0 or a
  /// disabled slot get 0), with the same gradients into the factors and x; undefined when no row has an adapter.
  /// What a caller adds to a base product it computed itself (models/stacked_experts.h: a grouped expert GEMM).
  at::Tensor adapter_update(const at::Tensor& x, const AdapterSegments& segments) const;

  /// Enables LoRA for `slot` with `rank` and `scaling`; A ~ kaiming-uniform(a=sqrt(5)) from `generator`
  /// (PEFT's default init), B = 0 so the fresh adapter equals the base model.
  /// Tensor parallel, a row-split layer: A is drawn at the whole layer's width `whole_in` and this shard's columns
  /// [in_begin, in_begin + in) kept, so every layout draws the same adapter (0: this layer is whole).
  void enable_slot(int64_t slot, int64_t rank, double scaling, at::Generator generator, int64_t whole_in = 0,
                   int64_t in_begin = 0);
  /// Enables `slot` with given PEFT-oriented factors (a frozen snapshot being made resident).
  void load_slot(int64_t slot, int64_t rank, double scaling, const at::Tensor& a, const at::Tensor& b);
  double slot_scaling(int64_t slot) const { return scalings_.at(slot); }
  /// Disables the slot and zeroes its factors (and their gradients), so nothing leaks to the next tenant.
  void disable_slot(int64_t slot);
  bool slot_enabled(int64_t slot) const { return ranks_.at(slot) > 0; }
  int64_t slot_rank(int64_t slot) const { return ranks_.at(slot); }

  /// PEFT orientation: A [rank, in], B [out, rank]. Views of the masters (narrowed to the slot's rank).
  at::Tensor lora_a(int64_t slot) const;
  at::Tensor lora_b(int64_t slot) const;
  /// Accumulated gradients of the slot's factors (same views as lora_a/lora_b); undefined if none yet.
  at::Tensor lora_a_grad(int64_t slot) const;
  at::Tensor lora_b_grad(int64_t slot) const;
  /// Zeroes the slot's accumulated gradients only (other slots keep theirs).
  void zero_slot_grad(int64_t slot);
  /// Takes the slot's accumulators (A [max_rank, in], B [out, max_rank]; undefined if none) out of the module,
  /// leaving none (the next backward allocates fresh zeroed ones); put_slot_grads puts a pair back as it was.
  /// How a batch accumulates all-or-nothing (backend/grad_transaction.h) and how optim_step frees them.
  std::pair<at::Tensor, at::Tensor> take_slot_grads(int64_t slot);
  void put_slot_grads(int64_t slot, std::pair<at::Tensor, at::Tensor> grads);
  /// The slot's gradient accumulators at the stacks' full size ([max_rank, in] / [out, max_rank]), allocated
  /// (zeroed) on first use. The autograd backward adds into them; only slots that trained hold memory.
  at::Tensor& slot_grad_a(int64_t slot) const;
  at::Tensor& slot_grad_b(int64_t slot) const;
  /// Copies PEFT-oriented factors into the slot; throws InvalidArgument on shape mismatch.
  void set_factors(int64_t slot, const at::Tensor& a, const at::Tensor& b);

  const at::Tensor& weight() const { return weight_; }
  /// Points the base weight at `storage` (same shape and dtype; e.g. one expert's slice of a stack) after copying
  /// the current values into it; every later read and in-place load of weight() goes to `storage`.
  void move_weight_into(at::Tensor storage);
  const at::Tensor& bias() const { return bias_; }
  /// The slot's whole factor storage at max_rank (A [max_rank, in], B [out, max_rank]); views.
  at::Tensor slot_storage_a(int64_t slot) const { return a_.select(0, slot); }
  at::Tensor slot_storage_b(int64_t slot) const { return b_.select(1, slot); }
  const at::Tensor& stacked_a() const { return a_; }
  const at::Tensor& stacked_b() const { return b_; }
  /// [S * max_rank] float32: slot s's scaling on its first rank_s columns, 0 elsewhere.
  const at::Tensor& column_scaling() const { return column_scaling_; }
  /// Brings the row-dense inference factors (the masters in the activation dtype `dtype`, B pre-multiplied by
  /// the column scaling) up to date, in place, if a factor or a scaling changed since. forward_row_dense calls
  /// it; a CUDA graph that replays that path without running it must call it before each replay.
  void prepare_inference(at::ScalarType dtype) const;
  /// Those factors, up to date: A [S * max_rank, in] and B pre-multiplied by the column scaling [out, S * max_rank],
  /// in `dtype`; for a caller that applies them in another arrangement (MLA's absorbed decode uses the transposes).
  std::pair<at::Tensor, at::Tensor> inference_factors(at::ScalarType dtype) const;
  int64_t in_features() const { return weight_.size(1); }
  int64_t out_features() const { return weight_.size(0); }

 private:
  at::Tensor weight_;  // [out, in], frozen
  at::Tensor bias_;    // [out] or undefined
  at::Tensor a_;       // [S, max_rank, in] float32; requires grad (so the backward runs), never gets a .grad
  at::Tensor b_;       // [out, S, max_rank] float32; likewise
  // [S * max_rank]: slot s's scaling on its first rank_s columns, 0 elsewhere (the row-dense path's mask).
  at::Tensor column_scaling_;
  // What the row-dense inference path multiplies by: two GEMMs in the activation dtype and one mask multiply per
  // step, instead of casting every slot's float32 factors (and scaling separately) on every step. Refreshed
  // only when the masters' (or the scalings') version counters moved: every update of them is an in-place op.
  struct InferenceFactors {
    at::Tensor a;         // [S * max_rank, in]: a view of the masters when the dtype is float32, else a copy
    at::Tensor b_scaled;  // [out, S * max_rank]: B with column j multiplied by column_scaling_[j]
    int64_t a_version = -1, b_version = -1, scaling_version = -1;
  };
  mutable InferenceFactors inference_;
  // [S]: each enabled slot's float32 factors as the inference path multiplies by them, A^T [in, rank] and
  // B^T [rank, out] (views of the masters, made when the slot's rank is set: a decode step's per-layer view ops
  // add up on a CPU); undefined for disabled slots.
  std::vector<at::Tensor> a_t_, b_t_;
  std::vector<int64_t> ranks_;    // [S]; 0 = LoRA off for this slot in this module
  std::vector<double> scalings_;  // [S]
  // Per-slot gradient accumulators, written by the autograd backward through a const module (hence mutable).
  mutable std::vector<at::Tensor> grad_a_;  // [S] of [max_rank, in] or undefined
  mutable std::vector<at::Tensor> grad_b_;  // [S] of [out, max_rank] or undefined

  /// forward (with_base) or adapter_update (without).
  at::Tensor apply(const at::Tensor& x, const AdapterSegments& segments, bool with_base) const;
  /// x [N, in], slot_columns [N, S * max_rank] (1 on the row's slot's columns) → [N, out].
  at::Tensor forward_row_dense(const at::Tensor& x, const at::Tensor& slot_columns, bool with_base) const;
  void set_slot_scaling(int64_t slot, int64_t rank, double scaling);
  static bool use_row_dense(const at::Tensor& x, int64_t lora_slots);
};

}  // namespace skyrl_tx::lora
