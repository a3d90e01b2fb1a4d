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

GENERATOR_VERSION = 1


def _init_(model: Any, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.ndim == 1 and "norm" in name:
                zero_centered = type(model).__name__.startswith("Qwen3_5") and "linear_attn.norm" not in name
                param.fill_(0.0 if zero_centered else 1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:  # drawn in float32 a tensor at a time (bf16 normal_ is not supported on every CPU build)
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).mul_(0.02))


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
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
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
