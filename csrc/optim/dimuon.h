// Dimuon: momentum, then Newton–Schulz orthogonalisation of each LoRA factor's update (Muon for LoRA).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "dist/tensor_parallel.h"
#include "optim/adamw.h"  // TrainableTensor, global_grad_norm

namespace skyrl_tx::optim {

/// The SDK's DimuonParams (tinker 0.38: learning_rate, grad_clip_norm, beta1).
struct DimuonParams {
  double learning_rate = 1e-4;
  double grad_clip_norm = 0.0;  // <= 0 = no clipping (the SDK: "nonpositive values disable gradient clipping")
  double beta1 = 0.9;

  /// Throws InvalidArgument naming the field (non-finite values, lr < 0, beta1 outside [0, 1)).
  void validate() const;
};

/// Quintic Newton–Schulz coefficients and step count of Keller Jordan's Muon.
constexpr double kNewtonSchulzA = 3.4445, kNewtonSchulzB = -4.7750, kNewtonSchulzC = 2.0315;
constexpr int kNewtonSchulzSteps = 5;
constexpr double kNewtonSchulzEps = 1e-7;

/// Approximate polar factor U·Vᵀ of each matrix of x [n, r, k] (r <= k), in float32: x is scaled to Frobenius
/// norm 1 (plus kNewtonSchulzEps, so zeros stay zeros), then kNewtonSchulzSteps quintic iterations
/// X ← a·X + (b·XXᵀ + c·(XXᵀ)²)·X drive every singular value towards 1.
at::Tensor newton_schulz(const at::Tensor& x);

/// Momentum of every LoRA factor of one model, plus its step count.
/// One step: g ← clip(grad) (global norm, as AdamW); m ← β1·m + (1−β1)·g; O ← NS(m) (A [r, in] as is,
/// B [out, r] as Bᵀ, so each is orthogonalised as an r × k matrix with r singular values ≈ 1 and Frobenius
/// norm ≈ √r); W ← W − lr·O. The same lr for A and B (no per-shape factor): the docs' "direction with
/// Frobenius norm sqrt(rank), rank correction applied uniformly to all LoRA matrices".
class DimuonState {
 public:
  /// Returns {"grad_norm" (before clipping), "learning_rate", "step"}. Every tensor must be a matrix. Under tensor
  /// parallelism (`tensors` are this rank's parts; collective) the momentum stays in parts, and each update is
  /// orthogonalised whole (gathered, then this rank's part taken): the result of one process.
  std::map<std::string, double> step(const std::vector<TrainableTensor>& tensors, const DimuonParams& params,
                                     const dist::TensorParallel& tp = dist::kNoTensorParallel);
  int64_t num_steps() const { return step_; }
  /// Momentum by tensor name (float32, the tensor's shape), for checkpoints.
  const std::map<std::string, at::Tensor>& momentum() const { return momentum_; }
  /// Replaces the whole state (a checkpoint restore); the caller has checked names and shapes.
  void restore(int64_t step, std::map<std::string, at::Tensor> momentum) {
    step_ = step;
    momentum_ = std::move(momentum);
  }

 private:
  int64_t step_ = 0;
  std::map<std::string, at::Tensor> momentum_;
};

}  // namespace skyrl_tx::optim
