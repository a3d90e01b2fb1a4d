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
    """All tensors of all shards by HF name; a name in two shards is an error. Layers past num_hidden_layers
    (DeepSeek V3's multi-token-prediction layers, which transformers ignores too) are left out."""
    from safetensors.torch import load_file

    extra_layers = _extra_layer_prefix(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(model_dir):
        for stored, tensor in load_file(str(shard)).items():
            name = text_model_weight_name(stored)
            if name is None:
                continue
            if name in weights:
                raise InvalidArgumentError(f"base model: tensor {name!r} appears in more than one shard")
            if extra_layers is not None and extra_layers(name):
                continue
            weights[name] = tensor
    return weights


# A vision-language checkpoint (Qwen3.5 on the hub) keeps its text model under model.language_model; its vision
# tower and multi-token-prediction head are not served (transformers' Qwen3_5ForCausalLM ignores them too).
_TEXT_MODEL_PREFIX = "model.language_model."
_NOT_SERVED_PREFIXES = ("model.visual.", "mtp.")


def text_model_weight_name(name: str) -> str | None:
    """The text model's name for a stored tensor, or None for a tensor the text model does not have."""
    if name.startswith(_NOT_SERVED_PREFIXES):
        return None
    return "model." + name[len(_TEXT_MODEL_PREFIX):] if name.startswith(_TEXT_MODEL_PREFIX) else name


def _extra_layer_prefix(model_dir: Path):
    """A predicate for tensors of layers >= num_hidden_layers when config.json declares such extra layers."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if raw.get("quantization_config"):
        from skyrl_tx.errors import UnimplementedError

        method = raw["quantization_config"].get("quant_method", "?")
        raise UnimplementedError(f"base model: quantized checkpoints ({method}) are not supported; "
                                 "use a bfloat16 or float32 copy of the weights")
    if not raw.get("num_nextn_predict_layers"):
        return None
    layers = int(raw["num_hidden_layers"])

    def extra(name: str) -> bool:
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers

    return extra
