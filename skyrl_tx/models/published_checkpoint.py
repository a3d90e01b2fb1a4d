"""Random-weight checkpoints of published models at reduced depth, in the hub's layout (sharded safetensors + index,
the hub's tensor names and config.json keys, bf16), so tests and plans run the code users run at real widths.

The weights are random (normal, std 0.02; norms around their identity), the tokenizer the project's own small BPE
(token ids stay below every published vocab): what is real is every width, name, dtype and the sharding.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from skyrl_tx.models.hf_config import text_model_config
from skyrl_tx.models.tiny_presets import cache_root
from skyrl_tx.models.tokenizer_builder import save_hf_tokenizer, special_token_ids
from skyrl_tx.plan.published import reduced

GENERATOR_VERSION = 2


POOL_NUMEL = 1 << 24  # 16M float32 normals (64 MiB) every tensor is cut from


def _init_(model: Any, seed: int) -> None:
    """Fills the (uninitialised) parameters: norms around their identity, biases zero, every other tensor std 0.02
    normals. Drawing 2.5e9 normals would take ~25 s on one core, so each tensor is copied from one pool of normals
    in runs of at most POOL_NUMEL, each run from its own random offset (so no two rows or tensors coincide)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * POOL_NUMEL, generator=gen, dtype=torch.float32).mul_(0.02)  # [2 * POOL_NUMEL]
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1 and "norm" in name:
                zero_centered = type(model).__name__.startswith("Qwen3_5") and "linear_attn.norm" not in name
                param.fill_(0.0 if zero_centered else 1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                flat = param.view(-1)
                for start in range(0, flat.numel(), POOL_NUMEL):
                    n = min(POOL_NUMEL, flat.numel() - start)
                    offset = int(torch.randint(0, POOL_NUMEL, (1,), generator=gen))
                    flat[start:start + n].copy_(pool[offset:offset + n])
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek V3's router bias: a checkpoint tensor
                buffer.zero_()


def write_reduced(name: str, out: Path, *, num_layers: int = 2, num_experts: int | None = None,
                  max_shard_size: str = "200MB", seed: int = 0) -> Path:
    """Writes `name` (a key of plan/published.PUBLISHED) cut to `num_layers` into `out` (built in a temp directory
    and renamed, so `out` is absent or complete)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_json = reduced(name, num_layers, num_experts=num_experts)
    raw = dict(text_model_config(config_json))
    raw.pop("quantization_config", None)  # random bf16 weights; FP8 checkpoints are the loader tests' business
    family = "llama3" if raw["model_type"] == "llama" else "qwen3"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tok = save_hf_tokenizer(tmp, family, 2048, 4096)
        ids = special_token_ids(tok, family)
        raw.update({k: v for k, v in ids.items() if v is not None})  # the project tokenizer's bos/eos/pad ids
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
        from transformers.initialization import no_init_weights

        with no_init_weights():  # transformers' own init draws bf16 normals, ~1.5 s per 1e8 on a CPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.tie_weights()  # init_weights, skipped, is where tying happens
        _init_(model, seed)
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        hub = dict(config_json)  # the hub's config.json keys, not transformers 5's rewrite of them
        text = hub.get("text_config", hub)
        text.update({k: v for k, v in ids.items() if v is not None})
        if "text_config" not in hub and hub.get("quantization_config"):
            hub.pop("quantization_config")
        (tmp / "config.json").write_text(json.dumps(hub, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():
            raise
    return out


def reduced_model_dir(name: str, *, num_layers: int = 2, num_experts: int | None = None) -> Path:
    """The reduced checkpoint under the skyrl_tx cache ($SKYRL_TX_CACHE_DIR), written on first use."""
    slug = name.replace("/", "--") + f"-L{num_layers}" + (f"-E{num_experts}" if num_experts else "")
    target = cache_root() / "published" / f"{slug}-v{GENERATOR_VERSION}"
    if target.is_dir():
        return target
    return write_reduced(name, target, num_layers=num_layers, num_experts=num_experts)
