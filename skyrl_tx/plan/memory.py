"""MemoryPlan: what each device of a layout holds at the peak, from config.json and --backend-config, before any load.

Every line is counted the way the core allocates it (csrc/lora/lora_linear.cpp: float32 factors of every slot of every
linear, allocated at start; csrc/sampling/kv_cache.cpp: K/V rows of max_sampling_length; csrc/optim: AdamW moments in
float32, float32 master weights for parameters stored in bfloat16). Activations are an estimate of what autograd
saves per token and layer (checked against a measured peak in tests/plan/test_real_shapes.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.models.architectures import BY_ARCHITECTURE
from skyrl_tx.models.hf_config import DecoderConfig
from skyrl_tx.plan.inventory import EXPERT, lora_linears, mlp_kinds, model_params

GiB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# What a process holds before any tensor: the interpreter, torch and the other libraries (CPU); the CUDA context,
# cuBLAS workspaces and the caching allocator's slack (GPU).
# (CPU: an engine process holds 0.51-0.52 GiB besides its tensors on the build machine, measured with
# /proc/PID/status: the tiny preset at load, and the published widths of tests/plan/test_real_shapes.py (VmRSS after
# load less weights and factors). The same test's engine peaks were 0.085-0.166 GiB higher on CI machines (Qwen3-0.6B
# 1.250 and 1.330 GiB against 1.164 here, Llama-3.1-8B 5.345 against 5.258): more of libtorch's code and the
# allocator's arenas resident, which depends on the machine. 0.62 GiB sits between them, within the test's 15%.)
RUNTIME_BYTES = {"cpu": int(0.62 * GiB), "cuda": int(1.0 * GiB)}
# Lines that are never live at once: a training step's activations, and (where the weights live in host memory) the
# checkpoint's tensors that loading holds while the model copies them. The peak adds the larger of the two.
TRANSIENT = ("activations", "loading")
# What to change when a line does not fit (named in the start-up refusal).
KNOBS = {
    "weights": "tensor_parallel_size (split the weights over more GPUs) or dtype \"bfloat16\"",
    "lora_factors": "max_lora_adapters, max_lora_rank or max_resident_snapshots (every slot's factors are allocated "
                    "at start)",
    "lora_training": "max_lora_adapters or max_lora_rank",
    "full_finetune": "max_full_models, or fully_sharded_data_parallel_size (shards gradients, moments and masters)",
    "kv_cache": "max_sampling_sequences or max_sampling_length (or kv_cache_tokens)",
    "activations": "train_micro_batch_tokens, or gradient_checkpointing true",
    "runtime": "nothing: the process itself",
    "loading": "tensor_parallel_size (each rank loads its share)",
    "snapshots": "snapshot_memory_mb (0: what the device has left), or max_full_models",
}
LABELS = {"weights": "base weights", "lora_factors": "LoRA slots (factors)",
          "lora_training": "LoRA gradients + AdamW moments", "full_finetune": "full fine-tunes (weights, grads, "
          "moments, masters)", "kv_cache": "KV cache", "activations": "activations (one micro-batch)",
          "runtime": "runtime (process, context)",
          "snapshots": "full fine-tunes' sampler snapshots", "loading": "loading (checkpoint held while copied; at start)"}


@dataclass
class DevicePlan:
    role: str  # "trainer rank 0" / "sampler engine 0"
    device: str  # "cpu" | "cuda:N"
    lines: dict[str, int] = field(default_factory=dict)  # LABELS key -> bytes

    @property
    def total(self) -> int:
        """The peak: everything resident plus the larger of the transients (they never overlap)."""
        resident = sum(v for k, v in self.lines.items() if k not in TRANSIENT)
        return resident + max((self.lines.get(k, 0) for k in TRANSIENT), default=0)

    def largest_adjustable(self) -> str:
        return max((k for k in self.lines if k not in ("runtime", "loading")), key=lambda k: self.lines[k])


@dataclass
class MemoryPlan:
    devices: list[DevicePlan]

    def render(self, capacity: dict[str, int] | None = None) -> str:
        rows = []
        for plan in self.devices:
            rows.append(f"{plan.role} ({plan.device}):")
            for key, size in plan.lines.items():
                rows.append(f"  {LABELS[key]:<48} {size / GiB:9.2f} GiB")
            cap = (capacity or {}).get(plan.device)
            fits = "" if cap is None else f"   of {cap / GiB:.2f} GiB: {'fits' if plan.total <= cap else 'DOES NOT FIT'}"
            rows.append(f"  {'peak (resident + the larger transient)':<48} {plan.total / GiB:9.2f} GiB{fits}")
        return "\n".join(rows)


def _linear_widths(config: DecoderConfig, tp: int, ep: int) -> int:
    """Sum over LoRA linears on one rank of (in + out): the factor columns per unit of rank and slot."""
    total = 0
    for p in lora_linears(config):
        share = 1 / ep if p.split == EXPERT else 1
        total += p.lora_width_per_rank(tp) * share
    return int(total)


def _weights_per_rank(config: DecoderConfig, tp: int, ep: int) -> int:
    return int(sum(p.numel_per_rank(tp) / (ep if p.split == EXPERT else 1) for p in model_params(config)))


def _expert_weights_per_rank(config: DecoderConfig, ep: int) -> int:
    return sum(p.numel for p in model_params(config) if p.split == EXPERT) // ep


def kv_row_bytes(config: DecoderConfig, max_len: int, dtype_bytes: int, tp: int) -> int:
    """One KvCache row (csrc/sampling/kv_cache.cpp): K and V of every attention layer (MLA: the latent and the rope
    key, no V) or a Gated DeltaNet layer's conv and float32 recurrent states."""
    spec = BY_ARCHITECTURE[config.architecture]
    total = 0
    for i in range(config.num_hidden_layers):
        if config.layer_types and config.layer_types[i] == "linear_attention":
            conv_dim = (2 * config.linear_num_key_heads * config.linear_key_head_dim
                        + config.linear_num_value_heads * config.linear_value_head_dim)
            total += conv_dim // tp * (config.linear_conv_kernel_dim - 1) * dtype_bytes
            total += (config.linear_num_value_heads // tp * config.linear_key_head_dim * config.linear_value_head_dim
                      * 4)
        elif spec.attention == "mla":
            total += max_len * (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes
        else:
            total += 2 * (config.num_key_value_heads // tp) * max_len * config.head_dim * dtype_bytes
    return total


def _activation_bytes_per_token(config: DecoderConfig, dtype_bytes: int, tp: int, checkpointing: bool) -> tuple[int, int]:
    """(saved for backward per token over all layers, one layer's transient in backward per token): what autograd
    keeps of each layer: its inputs, the normed inputs, q/k/v and the attention output, the MLP's gate, up and
    product (MoE: each routed copy of a token), in the compute dtype."""
    c = config
    spec = BY_ARCHITECTURE[c.architecture]
    layout = mlp_kinds(c)
    per_layer = []
    for i in range(c.num_hidden_layers):
        if c.layer_types and c.layer_types[i] == "linear_attention":
            conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            mixer = (3 * conv_dim + 3 * c.linear_num_value_heads * c.linear_value_head_dim) // tp
        elif spec.attention == "mla":
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            mixer = (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim
                     + c.num_attention_heads * (2 * qk + 2 * c.v_head_dim) // tp)
        else:
            q = c.num_attention_heads * c.head_dim * (2 if spec.attention == "gated_gqa" else 1)
            mixer = (2 * q + 2 * c.num_key_value_heads * c.head_dim) // tp
        if layout[i] == "moe":
            mlp = c.num_experts_per_tok * (c.hidden_size + 3 * c.moe_intermediate_size) + c.num_experts
            shared = c.moe_intermediate_size * c.n_shared_experts + c.shared_expert_intermediate_size
            mlp += 3 * shared // tp
        else:
            mlp = 3 * c.intermediate_size // tp
        per_layer.append((4 * c.hidden_size + mixer + mlp) * dtype_bytes)
    widest = max(per_layer)
    if checkpointing:  # each layer's input is kept; one layer's activations are recomputed at a time
        return c.num_hidden_layers * c.hidden_size * dtype_bytes + widest, widest
    return sum(per_layer), widest


def activation_bytes(config: DecoderConfig, settings: BackendSettings, dtype_bytes: int, tp: int) -> int:
    tokens = settings.train_micro_batch_tokens
    saved, transient = _activation_bytes_per_token(config, dtype_bytes, tp, settings.gradient_checkpointing)
    chunk = min(tokens, settings.logprobs_chunk_tokens)
    logits = chunk * (config.vocab_size // tp) * 4 * 3  # a chunk's float32 logits, log-softmax and gradient
    hidden_grads = tokens * config.hidden_size * 4 * 2  # the residual stream's gradient and its float32 norm
    return tokens * (saved + transient) + logits + hidden_grads


def check_tensor_parallel(config: DecoderConfig, tp: int) -> None:
    """The core's own refusal (csrc/models/causal_lm.cpp `validated`), before anything loads: tensor_parallel_size
    must divide the attention heads, the KV heads (not MLA's latent), a dense MLP's width and Gated DeltaNet's heads."""
    if tp == 1:
        return
    spec = BY_ARCHITECTURE[config.architecture]
    layout = mlp_kinds(config)
    widths = {"attention heads": config.num_attention_heads}
    if spec.attention != "mla":
        widths["KV heads"] = config.num_key_value_heads
    if "dense" in layout:
        widths["MLP width"] = config.intermediate_size
    if config.layer_types and "linear_attention" in config.layer_types:
        widths["linear-attention key heads"] = config.linear_num_key_heads
        widths["linear-attention value heads"] = config.linear_num_value_heads
    bad = {k: v for k, v in widths.items() if v % tp}
    if bad:
        raise InvalidArgumentError(
            f"--backend-config: tensor_parallel_size {tp} must divide the model's "
            f"{', '.join(f'{k} ({v})' for k, v in bad.items())}; choose a divisor of {math.gcd(*widths.values())}"
            + (" (or spread the experts over data-parallel ranks: tensor_parallel_size 1, expert_parallel_size = "
               "fully_sharded_data_parallel_size)" if config.num_experts else ""))


def plan_memory(config: DecoderConfig, settings: BackendSettings) -> MemoryPlan:
    """The peak of every device of the layout `settings` describes (worst case: every slot and full fine-tune live,
    every adapter trained since its last optim step)."""
    dtype_bytes = DTYPE_BYTES[settings.dtype]
    tp = settings.tensor_parallel_size
    check_tensor_parallel(config, tp)
    dp = settings.fully_sharded_data_parallel_size
    ep = settings.expert_parallel_size
    kind = "cpu" if settings.device == "cpu" else "cuda"
    weights = _weights_per_rank(config, tp, ep)
    slots = settings.max_lora_adapters + 1 + settings.max_resident_snapshots
    widths = _linear_widths(config, tp, ep)
    factors = widths * settings.max_lora_rank * slots * 4
    if kind == "cuda":  # the row-dense inference copies of every slot's factors, in the compute dtype
        factors += widths * settings.max_lora_rank * slots * dtype_bytes
    lora_training = 3 * widths * settings.max_lora_rank * settings.max_lora_adapters * 4  # grads + m + v
    # A full fine-tune: its own weights, their gradients, AdamW's two float32 moments and (bf16) float32 masters;
    # under ZeRO the gradients, moments and masters are sharded over the data-parallel ranks.
    optimizer_bytes = 4 + 4 + (4 if dtype_bytes < 4 else 0)
    full = settings.max_full_models * weights * (dtype_bytes + (dtype_bytes + optimizer_bytes) / dp)
    kv_rows = settings.max_sampling_sequences
    kv = kv_row_bytes(config, settings.max_sampling_length, dtype_bytes, tp) * kv_rows * (1 + settings.max_full_models)
    trainer = DevicePlan("trainer rank 0" + (f" of {dp * tp}" if dp * tp > 1 else ""), settings.device, {
        "weights": weights * dtype_bytes, "lora_factors": factors, "lora_training": lora_training,
        "full_finetune": int(full), "kv_cache": kv if settings.colocate_all else 0,
        "activations": activation_bytes(config, settings, dtype_bytes, tp), "runtime": RUNTIME_BYTES[kind],
        # the checkpoint's tensors (this rank's share, in the compute dtype) stay referenced until the model is built;
        # an MoE layer's experts are allocated one by one, then moved into stacks (csrc/models/stacked_experts.cpp):
        # the freed per-expert blocks stay in the process (measured: VmRSS after load holds them once more)
        "loading": (weights + _expert_weights_per_rank(config, ep)) * dtype_bytes if kind == "cpu" else 0,
        # frozen whole-model copies for sampling full fine-tunes, on this device (0: they take what is left)
        "snapshots": settings.snapshot_memory_mb << 20 if settings.max_full_models else 0})
    if settings.gpu_memory_utilization > 0:
        trainer.lines["kv_cache"] = 0  # sized at start from what is left (gpu_memory_utilization)
    devices = [trainer]
    if not settings.colocate_all:
        itp = settings.inference_engine_tensor_parallel_size
        iwidths = _linear_widths(config, itp, 1)
        for engine in range(settings.num_inference_engines):
            device = (settings.inference_engine_devices[engine] if settings.inference_engine_devices
                      else settings.device)
            devices.append(DevicePlan(f"sampler engine {engine}", device, {
                "weights": _weights_per_rank(config, itp, 1) * dtype_bytes,
                "lora_factors": iwidths * settings.max_lora_rank * slots * (4 + (dtype_bytes if kind == "cuda" else 0)),
                "kv_cache": kv_row_bytes(config, settings.max_sampling_length, dtype_bytes, itp) * kv_rows,
                "runtime": RUNTIME_BYTES[kind]}))
    return MemoryPlan(devices)
