"""What each `--backend-config` key means, for the generated reference page (docs_gen.backend_config_page): its
section, the layouts it matters for and its meaning. Every BackendSettings field needs an entry (tests/docs checks)."""

from __future__ import annotations

# key -> (section, layouts it matters for, meaning). Every BackendSettings field needs an entry (the test checks).
# Links are relative to docs/reference/.
BACKEND_CONFIG_DOCS: dict[str, tuple[str, str, str]] = {
    "max_lora_adapters": ("Models and adapters", "all",
                          "LoRA adapters live at once (slot 0 is the base model)"),
    "max_lora_rank": ("Models and adapters", "all", "largest rank a client may request"),
    "max_full_models": ("Models and adapters", "all", "full fine-tuning copies (`lora_rank=0`) live at once"),
    "dtype": ("Models and adapters", "all", "compute dtype: `float32` or `bfloat16`"),
    "device": ("Models and adapters", "all",
               "`cpu`, `cuda` or `cuda:N`; with several ranks, the first rank's device (rank r uses the r-th "
               "device from there)"),
    "seed": ("Models and adapters", "all", "seeds sampling requests that bring no seed"),
    "logprobs_chunk_tokens": ("Training", "all",
                              "tokens per `[tokens, vocab]` logits chunk (bounds memory on long sequences)"),
    "train_micro_batch_tokens": ("Training", "all",
                                 "tokens per forward/backward micro-batch, padding included (any batch size fits); "
                                 "on a CPU, about one sequence's worth (e.g. 512) trains as fast and holds a fraction "
                                 "of the activations"),
    "train_micro_batch_size": ("Training", "all",
                               "at most this many sequences per micro-batch as well (the seed README's key); 0: only "
                               "`train_micro_batch_tokens` bounds a micro-batch"),
    "gradient_checkpointing": ("Training", "all",
                               "recompute layer activations during backward (less memory, ~1/3 more compute)"),
    "train_packed_sequences": ("Training", "all",
                               "a micro-batch of mixed lengths lays its sequences back to back in one row, with "
                               "attention (and Gated DeltaNet state) kept inside each sequence: no padded work "
                               "([Packed training sequences](../training-and-sampling.md#packed-training-sequences)); "
                               "false: one right-padded row per sequence"),
    "max_sampling_sequences": ("Sampling and the KV cache", "all",
                               "sequences decoding at once (KV cache rows); more requests wait their turn"),
    "max_sampling_length": ("Sampling and the KV cache", "all", "prompt + completion tokens per sampled sequence"),
    "kv_cache_tokens": ("Sampling and the KV cache", "all",
                        "the KV cache by a token budget instead: `kv_cache_tokens // max_sampling_length` rows (any "
                        "device; give this or `max_sampling_sequences`)"),
    "gpu_memory_utilization": ("Sampling and the KV cache", "GPU",
                               "on a GPU, the KV cache by memory instead: the rows that fit in this fraction of the "
                               "device's memory once the weights (and anything else on it) are counted, as in vLLM. "
                               "Each KV cache of an engine (the base model's; each full fine-tune's) gets these rows"),
    "max_logprobs_k": ("Sampling and the KV cache", "all",
                       "largest k of top-k logprobs (prompt or sampled positions) and alternative draws a sample may "
                       "ask"),
    "sample_packed_prefill": ("Sampling and the KV cache", "all",
                              "sampling prompts of mixed lengths prefill back to back in one row (varlen attention, "
                              "each token's K/V to its request's cache row, a Gated DeltaNet's state at each prompt's "
                              "end): no padded work; false: one right-padded row per prompt"),
    "prefix_caching": ("Sampling and the KV cache", "all",
                       "keep finished sequences' K/V and serve later prompts' matching prefixes from them (base model "
                       "and snapshots; [Prefix caching](../training-and-sampling.md#prefix-caching))"),
    "max_resident_snapshots": ("Sampling and the KV cache", "all",
                               "frozen adapter versions held in device slots; older ones wait in host memory"),
    "cuda_graphs": ("Sampling and the KV cache", "GPU",
                    "on a GPU, each decode step shape (batch rounded up to a power of two, keys to a multiple of 128) "
                    "is captured once as a CUDA graph and replayed: no per-kernel launch cost; ignored on a CPU"),
    "snapshot_memory_mb": ("Sampling and the KV cache", "all",
                           "device memory for full fine-tuning sampler snapshots (whole-model copies); beyond it the "
                           "least recently sampled move to disk and load back when sampled; 0: what the device has "
                           "left after the memory plan's peak (`skyrl-tx plan`)"),
    "num_threads": ("Engine", "all",
                    "the engine's torch intra-op threads; 0: chosen from the cores it owns ([Thread pools on a shared "
                    "CPU](../operating.md#thread-pools-on-a-shared-cpu)); `OMP_NUM_THREADS` wins"),
    "sampling_share": ("Engine", "all",
                       "device time decoding keeps while training also waits: after a training pass (and optim "
                       "steps) of T s, decode steps run for T·share/(1−share) s before the next pass; 0 = one decode "
                       "step per pass"),
    "recovery_snapshot_every_steps": ("Engine", "all",
                                      "after every N optim steps (or `recovery_snapshot_every_s`) a model's weights + "
                                      "optimizer state are written in the background, so a restart replays only the "
                                      "requests after it; 0 = never"),
    "recovery_snapshot_every_s": ("Engine", "all",
                                  "after an optim step, a recovery snapshot is also taken when this many seconds "
                                  "have passed since the model's last one (sooner than "
                                  "`recovery_snapshot_every_steps` steps)"),
    "futures_retention_hours": ("Engine", "all",
                                "finished requests older than this are pruned (never what recovery still needs); "
                                "must exceed any client's retry horizon"),
    "fully_sharded_data_parallel_size": ("Parallel layouts", "data parallel",
                                         "data-parallel ranks, one process each ([Data parallelism]"
                                         "(../scaling.md#data-parallelism)); a full fine-tune's gradients and AdamW "
                                         "moments are sharded over them (ZeRO-2)"),
    "zero_bucket_mb": ("Parallel layouts", "data parallel",
                       "data parallel, full fine-tuning: float32 MB per reduce-scatter / all-gather bucket (all "
                       "ranks' parts together), which bounds the extra memory sharding needs"),
    "tensor_parallel_size": ("Parallel layouts", "tensor parallel",
                             "ranks each layer (heads, MLP columns, vocabulary) is split over, one process each; with "
                             "`fully_sharded_data_parallel_size` D, D × T ranks ([Tensor parallelism]"
                             "(../scaling.md#tensor-parallelism))"),
    "expert_parallel_size": ("Parallel layouts", "tensor parallel, data parallel",
                             "1; `tensor_parallel_size`: spread every MoE layer's experts over the tensor-parallel "
                             "ranks; or, with `tensor_parallel_size` 1, `fully_sharded_data_parallel_size`: spread "
                             "them over the data-parallel ranks, tokens exchanged all-to-all (LoRA only)"),
    "grouped_expert_gemm": ("Parallel layouts", "all (MoE models)",
                            "MoE experts as grouped GEMMs over stacked weights: `\"auto\"` on CUDA bfloat16 with "
                            "compute capability ≥ 9.0, `\"always\"` wherever libtorch has the op, `\"never\"`: one "
                            "matmul chain per expert ([Mixture-of-experts models]"
                            "(../models.md#mixture-of-experts-models))"),
    "num_processes": ("Parallel layouts", "multi-node",
                      "node processes the ranks are spread over evenly; the others run `skyrl-tx worker` "
                      "([Multi-node](../scaling.md#multi-node))"),
    "coordinator_address": ("Parallel layouts", "multi-node",
                            "`HOST:PORT` where the engine's node hosts the rendezvous (needed with `num_processes` > "
                            "1); empty: a free local port"),
    "colocate_all": ("Sampler engines", "sampler engines",
                     "sample inside the training engine; false: on `num_inference_engines` sampler engine processes "
                     "kept current by weight syncs ([Sampler engines](../scaling.md#sampler-engines-on-their-own-"
                     "devices-disaggregated-placement))"),
    "num_inference_engines": ("Sampler engines", "sampler engines",
                              "sampler engines when `colocate_all` is false"),
    "inference_engine_tensor_parallel_size": ("Sampler engines", "sampler engines",
                                              "devices per sampler engine: each engine is that many "
                                              "tensor-parallel ranks"),
    "inference_engine_devices": ("Sampler engines", "sampler engines",
                                 "each sampler engine's first device, e.g. `[\"cuda:4\", \"cuda:6\"]` (an engine of T "
                                 "ranks takes T from there); empty: the devices after the trainer's"),
    "inference_engine_timeout_s": ("Sampler engines", "sampler engines",
                                   "a sampler engine silent this long while it owes results is taken for hung: "
                                   "killed, and replaced by a fresh one"),
    "weight_sync_digests": ("Sampler engines", "sampler engines",
                            "debugging: hash every weight sync on the trainer and on each sampler engine and log the "
                            "digests; an engine holding other weights fails the save"),
}
