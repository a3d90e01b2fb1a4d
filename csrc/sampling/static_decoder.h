// StaticDecoder: a decode step at fixed shapes (rows and key length rounded up to buckets, LoRA per row from a
// device tensor), so that on a GPU each shape is captured once as a CUDA graph and then replayed.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "models/causal_lm.h"
#include "sampling/kv_cache.h"

namespace skyrl_tx::sampling {

/// How the generator runs decode steps.
enum class DecodeMode {
  kEager,      // exact batch and key length, host-side adapter segments (CPU default)
  kStatic,     // bucketed shapes + row-dense LoRA, run eagerly (the graph path's math, testable on a CPU)
  kCudaGraph,  // kStatic captured once per shape as a CUDA graph, then replayed (GPU default)
};

class StaticDecoder {
 public:
  static constexpr int64_t kKeyBucket = 128;  // key lengths round up to a multiple of this (fewer graphs)

  /// NOTE: model and cache must outlive the decoder; graphs read their tensors' storage, so neither may
  /// reallocate (weights and LoRA factors are only ever updated in place).
  StaticDecoder(const models::CausalLM& model, const KvCache& cache, int64_t max_rows, int64_t max_length,
                bool cuda_graphs);
  ~StaticDecoder();

  /// One decode step of cache rows [0, batch): tokens, positions and adapter slots per row (free rows carry
  /// zeros and are discarded). attend_len: keys [0, attend_len) cover every row's context. → float logits
  /// [batch, vocab], valid until the next call.
  at::Tensor step(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                  const std::vector<int64_t>& slots, int64_t attend_len);

 private:
  struct Shape;
  Shape& shape_for(int64_t rows, int64_t keys);
  /// The step's math from the shape's static inputs; writes logits into the shape's output buffer.
  void forward(Shape& shape) const;

  const models::CausalLM& model_;
  const KvCache& cache_;
  int64_t max_rows_, max_length_;
  bool cuda_graphs_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<Shape>> shapes_;
  std::map<int64_t, at::Tensor> logits_by_rows_;  // [rows, vocab] float, shared by every key bucket
  struct GraphPool;
  std::unique_ptr<GraphPool> pool_;  // CUDA graph memory pool shared by all shapes (they never run at once)
};

}  // namespace skyrl_tx::sampling
