// BackendConfig: server-wide limits and compute settings for one base model (from --backend-config).
#pragma once

#include <cstdint>
#include <string>

namespace skyrl_tx::backend {

struct BackendConfig {
  int64_t max_lora_adapters = 8;       // live adapters (slots 1..N); slot 0 is the base model
  int64_t max_lora_rank = 32;
  std::string dtype = "float32";       // compute dtype: "float32" or "bfloat16"
  std::string device = "cpu";          // "cpu", "cuda", "cuda:N"
  int64_t logprobs_chunk_tokens = 1024;  // rows of [tokens, vocab] logits materialised at once
  uint64_t seed = 0;
  int64_t max_full_models = 1;              // full fine-tuning copies (lora_rank = 0) live at once
  int64_t train_micro_batch_tokens = 8192;  // tokens per forward/backward micro-batch (padding included)
  int64_t train_micro_batch_size = 0;       // at most this many sequences per micro-batch too (the seed key); 0: any
  bool gradient_checkpointing = false;      // recompute layer activations in backward to save memory
  // Micro-batches of mixed lengths pack their sequences back to back in one row (varlen attention, no padding);
  // false: one right-padded row per sequence (batching/packing.h).
  bool train_packed_sequences = true;
  int64_t max_sampling_sequences = 16;      // sequences decoding at once (KV cache rows)
  int64_t max_sampling_length = 2048;       // prompt + completion tokens per sampled sequence
  // On a GPU, > 0: the KV cache gets the rows that fit in this fraction of the device's memory after the weights
  // (and whatever else is on it) are counted; max_sampling_sequences is then set from it (sampling/kv_budget.h).
  double gpu_memory_utilization = 0.0;
  int64_t max_logprobs_k = 20;              // largest top-k logprobs / alternative draws per position
  bool prefix_caching = true;               // reuse cached prompt prefixes of immutable weights (base, snapshots)
  // Sampling prompts of mixed lengths prefill back to back in one row (varlen attention; sampling/generator.h).
  bool sample_packed_prefill = true;
  int64_t max_resident_snapshots = 4;       // frozen adapter versions in device slots (LRU to host beyond)
  bool cuda_graphs = true;                  // on a GPU, capture each decode step shape once and replay it
  int64_t zero_bucket_mb = 256;             // data parallel, full fine-tuning: float32 MB per ZeRO collective
  int64_t expert_parallel_size = 1;         // 1, or tensor parallel size: MoE experts spread over those ranks
  // MoE experts as grouped GEMMs over stacked weights: "auto" (CUDA bfloat16, compute capability >= 9.0),
  // "always" (wherever libtorch has the op: a CPU runs ATen's reference loop, CUDA needs bfloat16 on >= 8.0),
  // "never" (one matmul chain per expert).
  std::string grouped_expert_gemm = "auto";

  /// Throws InvalidArgument naming the field.
  void validate() const;
};

}  // namespace skyrl_tx::backend
