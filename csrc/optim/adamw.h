// AdamW with decoupled weight decay and global-norm clipping, applied to one model's tensors at a time.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "dist/tensor_parallel.h"

namespace skyrl_tx::optim {

/// The SDK's AdamParams; semantics of torch.optim.AdamW (Loshchilov & Hutter 2019).
struct AdamParams {
  double learning_rate = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-12;
  double weight_decay = 0.0;
  double grad_clip_norm = 0.0;  // 0 = no clipping

  /// Throws InvalidArgument naming the field (lr < 0, betas outside [0, 1), eps < 0, ...).
  void validate() const;
};

/// One trainable tensor of a model: a view of its parameter and of its gradient (same shape).
struct TrainableTensor {
  std::string name;
  at::Tensor param;  // updated in place
  at::Tensor grad;   // undefined = no gradient accumulated yet (treated as zeros)
  dist::TensorSplit split;  // tensor parallelism: how the group holds it (replicated by default)
};

/// First and second moments of every tensor of one model, plus its step count, plus a float32 master copy of every
/// tensor stored in a lower precision (bfloat16 full fine-tuning weights).
/// NOTE: each model owns its own state, so stepping one adapter never touches another.
/// Master weights: a step updates the master and casts it into the parameter, so an update below half an ulp of
/// the parameter's dtype (lr·update ~ 1e-5 on bf16 weights near 1) accumulates instead of being rounded away
/// (mixed-precision training's fp32 master weights, Micikevicius et al. 2018). Float32 parameters (LoRA factors,
/// float32 models) are their own master: no copy. A master is made from the parameter at the first step that needs
/// it, and only ever written by step: whoever overwrites a parameter must drop_masters() (rebuilt at the next step).
class AdamState {
 public:
  /// Clips (if asked), then applies one AdamW step to every tensor. Returns metrics
  /// {"grad_norm" (before clipping), "learning_rate", "step"}.
  /// `tp`: the tensors' tensor-parallel group (their sharded parts count once each in the clipping norm).
  std::map<std::string, double> step(const std::vector<TrainableTensor>& tensors, const AdamParams& params,
                                     const dist::TensorParallel& tp = dist::TensorParallel());
  int64_t num_steps() const { return step_; }
  /// Moments by tensor name (exp_avg, exp_avg_sq), for checkpoints.
  const std::map<std::string, std::pair<at::Tensor, at::Tensor>>& moments() const { return moments_; }
  /// Float32 master weights by tensor name: one per stepped tensor whose parameter is not float32 (empty before
  /// the first step, and after drop_masters).
  const std::map<std::string, at::Tensor>& masters() const { return masters_; }
  /// Forgets the masters (the parameters were overwritten, e.g. by loaded weights): the next step rebuilds them
  /// from the parameters.
  void drop_masters() { masters_.clear(); }
  /// Replaces the whole state (a checkpoint restore); the caller has checked names and shapes, and that each
  /// master rounds to its parameter. Masters left out are rebuilt from their parameters at the next step.
  void restore(int64_t step, std::map<std::string, std::pair<at::Tensor, at::Tensor>> moments,
               std::map<std::string, at::Tensor> masters = {}) {
    step_ = step;
    moments_ = std::move(moments);
    masters_ = std::move(masters);
  }

 private:
  int64_t step_ = 0;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> moments_;  // float32, like the params
  std::map<std::string, at::Tensor> masters_;                        // float32, contiguous, the params' shapes
};

/// sqrt(sum of squared L2 norms) of the defined gradients, in float64 for a stable sum.
/// Under tensor parallelism, the norm of the whole tensors: the shards' squares summed over `tp`, the replicated
/// tensors' counted once.
double global_grad_norm(const std::vector<TrainableTensor>& tensors,
                        const dist::TensorParallel& tp = dist::TensorParallel());

}  // namespace skyrl_tx::optim
