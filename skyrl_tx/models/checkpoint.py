"""Base-model resolution (preset name, local directory or hub id) and reading every safetensors shard."""

from __future__ import annotations

import json
import logging
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


def load_weights(model_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of all shards by HF name; a name in two shards is an error. Layers past num_hidden_layers
    (DeepSeek V3's multi-token-prediction layer, which transformers ignores too) are left out, with one log line.

    FP8 block-quantised checkpoints (DeepSeek V3 as published: `quantization_config` {quant_method: fp8, fmt: e4m3,
    weight_block_size}, each float8_e4m3fn `<name>.weight` with a float32 `<name>.weight_scale_inv`) are dequantised
    here to `dtype` (the compute dtype; bfloat16 when None): weight (as float32) times its block's scale, as
    transformers' finegrained-FP8 dequantisation does, edge blocks ragged. Other tensors keep their stored dtype."""
    from contextlib import ExitStack

    from safetensors import safe_open

    raw = _config_json(model_dir)
    block = _fp8_block_size(raw)
    extra = _extra_layer_predicate(raw)
    with ExitStack() as stack:
        where: dict[str, tuple] = {}  # HF name -> (open shard, stored name)
        for shard in safetensors_files(model_dir):
            handle = stack.enter_context(safe_open(str(shard), framework="pt"))
            for stored in handle.keys():
                name = text_model_weight_name(stored)
                if name is None:
                    continue
                if name in where:
                    raise InvalidArgumentError(f"base model: tensor {name!r} appears in more than one shard")
                where[name] = (handle, stored)
        skipped = sorted(n for n in where if extra is not None and extra(n))
        if skipped:
            layers = sorted({int(n.split(".")[2]) for n in skipped})
            logging.getLogger("skyrl_tx.models").info(
                "base model: leaving out %d tensors of layer(s) %s past num_hidden_layers=%d (the multi-token-"
                "prediction layer, not used for training or sampling)", len(skipped), layers, raw["num_hidden_layers"])
        weights: dict[str, torch.Tensor] = {}
        scales = {n for n in where if n.endswith(_SCALE_SUFFIX)}
        used_scales: set[str] = set()
        for name, (handle, stored) in where.items():
            if name in scales or (extra is not None and extra(name)):
                continue
            tensor = handle.get_tensor(stored)
            if tensor.dtype.is_floating_point and tensor.element_size() == 1 and tensor.dtype not in _fp8_dtypes():
                from skyrl_tx.errors import UnimplementedError

                raise UnimplementedError(f"base model: tensor {stored!r} is {tensor.dtype}; only float8_e4m3fn "
                                         "weights with block scales are dequantised: use a bfloat16 copy")
            if tensor.dtype in _fp8_dtypes():
                scale_name = name + "_scale_inv" if name.endswith(".weight") else None
                if block is None:
                    raise InvalidArgumentError(
                        f"base model: tensor {stored!r} is {tensor.dtype} but config.json has no FP8 "
                        "quantization_config; use a bfloat16 or float32 copy of the weights")
                if scale_name is None or scale_name not in where:
                    raise InvalidArgumentError(
                        f"base model: FP8 tensor {stored!r} has no {stored + '_scale_inv'!r} beside it, so it cannot "
                        "be dequantised; the checkpoint is incomplete (fetch every shard named by "
                        "model.safetensors.index.json) or use a bfloat16 copy of the weights")
                scale_handle, scale_stored = where[scale_name]
                tensor = dequantize_fp8(tensor, scale_handle.get_tensor(scale_stored), block, dtype, stored)
                used_scales.add(scale_name)
            weights[name] = tensor
        orphans = sorted(n for n in scales - used_scales if extra is None or not extra(n))
        if orphans:
            raise InvalidArgumentError(f"base model: {orphans[0]!r} scales a tensor that is not float8_e4m3fn "
                                       f"({len(orphans)} such scale(s)); the checkpoint mixes quantised and "
                                       "dequantised files: use one complete copy")
    return weights


_SCALE_SUFFIX = ".weight_scale_inv"
# What the loader understands of an FP8 quantization_config (transformers' FineGrainedFP8Config as DeepSeek V3
# publishes it); any other key or value is refused rather than guessed at.
_FP8_DEFAULTS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "float",
                 "expert_dtype": "fp8"}
_FP8_IGNORED = {"weight_block_size", "modules_to_not_convert", "ignored_layers", "dequantize"}


def _fp8_dtypes() -> tuple:
    import torch

    return (torch.float8_e4m3fn,)


def _config_json(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _fp8_block_size(raw: dict) -> tuple[int, int] | None:
    """(rows, cols) of an FP8 block-quantised checkpoint's scale blocks; None when config.json declares no
    quantization. Raises UnimplementedError, naming the key and the way out, for any quantization it does not know."""
    from skyrl_tx.errors import UnimplementedError

    config = raw.get("quantization_config")
    if not config:
        return None
    fix = ("skyrl_tx dequantises only FP8 e4m3 checkpoints with float32 block scales (DeepSeek V3's "
           "quantization_config); use a bfloat16 or float32 copy of the weights")
    for key, value in config.items():
        if key in _FP8_DEFAULTS and str(value).lower() != _FP8_DEFAULTS[key]:
            raise UnimplementedError(f"base model: config.json quantization_config.{key} = {value!r} is not "
                                     f"supported; {fix}")
        if key not in _FP8_DEFAULTS and key not in _FP8_IGNORED:
            raise UnimplementedError(f"base model: config.json quantization_config.{key} is not understood; {fix}")
    if config.get("quant_method") != "fp8":
        raise UnimplementedError(f"base model: config.json quantization_config has no quant_method 'fp8'; {fix}")
    size = config.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)):
        raise UnimplementedError(f"base model: config.json quantization_config.weight_block_size = {size!r} is not "
                                 f"[rows, cols] of positive integers (per-tensor FP8 scales are not supported); {fix}")
    return int(size[0]), int(size[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype | None = None, name: str = "weight") -> torch.Tensor:
    """weight [rows, cols] float8 and scale_inv [ceil(rows / block[0]), ceil(cols / block[1])] float32 ->
    weight.float() * scale_inv[i // block[0], j // block[1]], in `dtype` (bfloat16 when None). The product is taken
    in float32 and rounded once, as transformers' dequantisation does."""
    import torch

    if weight.dim() != 2:
        raise InvalidArgumentError(f"base model: FP8 tensor {name!r} has shape {list(weight.shape)}; block scales "
                                   "need a 2-D weight")
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise InvalidArgumentError(f"base model: {name + '_scale_inv'!r} has shape {list(scale_inv.shape)}, not "
                                   f"{list(expected)} ({name!r} is {rows}x{cols} in {block[0]}x{block[1]} blocks)")
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.to(torch.float32) * scale).to(dtype or torch.bfloat16)


# A vision-language checkpoint (Qwen3.5 on the hub) keeps its text model under model.language_model; its vision
# tower and multi-token-prediction head are not served (transformers' Qwen3_5ForCausalLM ignores them too).
_TEXT_MODEL_PREFIX = "model.language_model."
_NOT_SERVED_PREFIXES = ("model.visual.", "mtp.")


def stored_text_prefix(model_dir: Path) -> str:
    """How the checkpoint names its text model: "model.language_model." for a vision-language checkpoint (Qwen3.5
    on the hub), else "model.". Exports of a model trained on it use the same names (PEFT on
    Qwen3_5ForConditionalGeneration loads `model.language_model.layers.*`, not the text model's `model.layers.*`)."""
    return _TEXT_MODEL_PREFIX if any(n.startswith(_TEXT_MODEL_PREFIX) for n in _stored_names(model_dir)) else "model."


def as_stored_name(name: str, prefix: str) -> str:
    """The text model's name `name` (model.*, lm_head.*) as a checkpoint whose text model is under `prefix` has it."""
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def not_served_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The stored tensors the text model does not have (a vision tower, Qwen3.5's mtp.*), by their stored names: a
    Hugging Face export of a vision-language checkpoint carries them over unchanged."""
    from safetensors import safe_open

    out = {}
    for shard in safetensors_files(model_dir):
        with safe_open(str(shard), framework="pt") as handle:
            out |= {n: handle.get_tensor(n) for n in handle.keys() if text_model_weight_name(n) is None}
    return out


def _stored_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for shard in safetensors_files(model_dir):
        with safe_open(str(shard), framework="pt") as handle:
            names += list(handle.keys())
    return names


def text_model_weight_name(name: str) -> str | None:
    """The text model's name for a stored tensor, or None for a tensor the text model does not have."""
    if name.startswith(_NOT_SERVED_PREFIXES):
        return None
    return "model." + name[len(_TEXT_MODEL_PREFIX):] if name.startswith(_TEXT_MODEL_PREFIX) else name


def _extra_layer_predicate(raw: dict):
    """A predicate for tensors of layers >= num_hidden_layers when the checkpoint has such extra layers: DeepSeek V3's
    multi-token-prediction layer (config.json num_nextn_predict_layers; transformers' DeepseekV3 ignores layer 61)."""
    if not (raw.get("num_nextn_predict_layers") or raw.get("model_type") == "deepseek_v3"):
        return None
    layers = int(raw["num_hidden_layers"])

    def extra(name: str) -> bool:
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers

    return extra
