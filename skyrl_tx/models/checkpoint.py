"""Base-model resolution (preset name, local directory or hub id) and reading every safetensors shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from skyrl_tx.errors import InvalidArgumentError, NotFoundError

if TYPE_CHECKING:  # the API server resolves the base model here and must not load torch (only the engine does)
    import torch


def resolve_model_path(name: str) -> Path:
    """A tiny preset (generated on first use), a local HF directory, or a hub id already in the HF cache
    (or downloadable when online)."""
    from skyrl_tx.models.tiny_presets import resolve_preset

    preset = resolve_preset(name)
    if preset is not None:
        return preset
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise InvalidArgumentError(f"base model: directory {local} has no config.json")
        return local.resolve()
    if name.count("/") != 1:
        raise NotFoundError(f"base model: {name!r} is not a preset, a local directory or a hub id 'org/name'")
    return _from_hub(name)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not cached yet: try the network once, with a clear error offline
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns))
        except Exception as exc:
            raise NotFoundError(
                f"base model: cannot find {repo_id!r} in the Hugging Face cache or download it ({exc}); "
                "pass a local model directory or a preset such as tiny-qwen3"
            ) from exc


def safetensors_files(model_dir: Path) -> list[Path]:
    """Shards named by model.safetensors.index.json, else every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidArgumentError(f"base model: no .safetensors files in {model_dir}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InvalidArgumentError(f"base model: index names missing shard(s) {', '.join(missing)}")
    return files


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of all shards by HF name; a name in two shards is an error."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(model_dir):
        for name, tensor in load_file(str(shard)).items():
            if name in weights:
                raise InvalidArgumentError(f"base model: tensor {name!r} appears in more than one shard")
            weights[name] = tensor
    return weights
