"""Benchmark model shapes and workload sizes (CPU, GPU, tiny smoke test) and their cached random-weight checkpoints."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from skyrl_tx.models.tiny_presets import PRESETS, TinyPreset, cache_root
from skyrl_tx.models.tiny_presets import _write_model as write_preset_model


@dataclasses.dataclass(frozen=True)
class Workload:
    """How much work each measurement does (identical for skyrl_tx and HF + PEFT)."""

    train_seq_len: int  # tokens per training sequence
    train_batch: int  # sequences per forward_backward; N-adapter runs give each adapter this many / N (at least 1)
    sample_prompt_len: int
    sample_new_tokens: int
    lora_rank: int = 16


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """A named model + workload. `vocab_size` None: the trained tokenizer's size; else padded up to it."""

    name: str
    preset: TinyPreset
    workload: Workload
    dtype: str  # float32 | bfloat16
    vocab_size: int | None = None


_BASE = PRESETS["tiny-qwen3"]

CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    # Smoke test only: tiny-qwen3's shape, minimal work.
    BenchConfig("tiny", dataclasses.replace(_BASE, name="bench-tiny"),
                Workload(train_seq_len=32, train_batch=4, sample_prompt_len=8, sample_new_tokens=32, lora_rank=4),
                dtype="float32"),
    # CPU: a small Qwen3 where the matmuls dominate (≈27M parameters, 8 layers, hidden 512).
    BenchConfig("cpu", dataclasses.replace(_BASE, name="bench-cpu", hidden_size=512, intermediate_size=1536,
                                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                           head_dim=64),
                Workload(train_seq_len=256, train_batch=4, sample_prompt_len=32, sample_new_tokens=64),
                dtype="float32"),
    # CPU, Qwen3.5-shaped (the hybrid family): the cpu config's width with 3 Gated DeltaNet layers per gated
    # attention layer (as Qwen3.5), DeltaNet heads scaled like Qwen3.5-9B's (value heads twice the key heads).
    BenchConfig("cpu-qwen3.5", dataclasses.replace(
        PRESETS["tiny-qwen3.5"], name="bench-cpu-qwen3.5", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        extra_config={"layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                      + ["full_attention"], "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                      "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
                      "partial_rotary_factor": 0.25}),
                Workload(train_seq_len=256, train_batch=4, sample_prompt_len=32, sample_new_tokens=64),
                dtype="float32"),
    # CPU, mixture of experts with the `cpu` config's active size: every layer 8 experts of width 768, top-2 (a
    # token runs 2 x 768 = the dense 1536), Qwen3-30B-A3B's routing (softmax top-k, renormalised).
    BenchConfig("cpu-moe", dataclasses.replace(
        PRESETS["tiny-qwen3-moe"], name="bench-cpu-moe", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        extra_config={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
                Workload(train_seq_len=256, train_batch=4, sample_prompt_len=32, sample_new_tokens=64),
                dtype="float32"),
    # GPU: Qwen3-0.6B's shape (28 layers, hidden 1024, GQA 16/8, head_dim 128, tied, 151936 vocab) in bf16.
    BenchConfig("qwen3-0.6b", dataclasses.replace(_BASE, name="bench-qwen3-0.6b", hidden_size=1024,
                                                  intermediate_size=3072, num_hidden_layers=28,
                                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                                  tie_word_embeddings=True, max_position_embeddings=40960),
                Workload(train_seq_len=1024, train_batch=8, sample_prompt_len=128, sample_new_tokens=128),
                dtype="bfloat16", vocab_size=151936),
    # GPU: Qwen3-8B's shape (36 layers, hidden 4096, GQA 32/8 of 128, MLP 12288, untied, 151936 vocab) in bf16: the
    # issue's 8B target (≈39% MFU). Its random checkpoint is ~16 GB on disk, written once (built in float32 and cast:
    # ~48 GB of host memory at the peak); 2 x 2048 training tokens hold ~25 GB of activations.
    BenchConfig("qwen3-8b", dataclasses.replace(_BASE, name="bench-qwen3-8b", hidden_size=4096,
                                                intermediate_size=12288, num_hidden_layers=36,
                                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                                tie_word_embeddings=False, max_position_embeddings=40960),
                Workload(train_seq_len=2048, train_batch=2, sample_prompt_len=128, sample_new_tokens=128),
                dtype="bfloat16", vocab_size=151936),
    # GPU: a 4-layer stack of Qwen3-30B-A3B's layers (hidden 2048, GQA 32/4 of 128, 128 experts of width 768,
    # top-8, renormalised; 151936 vocab) in bf16: the routed MLP at real size (about 2.4B parameters, 0.6B active).
    BenchConfig("qwen3-30b-a3b-layers", dataclasses.replace(
        PRESETS["tiny-qwen3-moe"], name="bench-qwen3-30b-a3b-layers", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960,
        extra_config={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
                Workload(train_seq_len=1024, train_batch=8, sample_prompt_len=128, sample_new_tokens=128),
                dtype="bfloat16", vocab_size=151936),
)}


def default_config(device: str) -> str:
    return "cpu" if device == "cpu" else "qwen3-0.6b"


def _spec_hash(cfg: BenchConfig) -> str:
    spec = {**dataclasses.asdict(cfg.preset), "vocab_size": cfg.vocab_size, "dtype": cfg.dtype}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _write_model(cfg: BenchConfig, out: Path) -> None:
    write_preset_model(cfg.preset, out, None, min_vocab_size=cfg.vocab_size or 0, dtype=cfg.dtype)


def model_dir(cfg: BenchConfig) -> Path:
    """The config's checkpoint under the skyrl_tx cache (generated once, atomically; weights stored in cfg.dtype)."""
    target = cache_root() / "bench" / f"{cfg.name}-{_spec_hash(cfg)}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_model(cfg, tmp)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
