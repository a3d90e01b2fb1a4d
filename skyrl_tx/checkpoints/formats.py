"""Checkpoint file formats: PEFT adapters, Hugging Face model directories, optimizer state, our metadata.

Every checkpoint directory holds `skyrl_state.json` (ModelMeta) so it can be loaded without the database.
- weights (training state): the trainable tensors (adapter_model.safetensors for LoRA, model.safetensors
  for full fine-tuning) + optimizer.safetensors (AdamW moments or Dimuon momentum, and the float32 master
  weights of a bfloat16 full fine-tune; step and optimizer kind in the metadata).
- sampler_weights / external_weights: a PEFT adapter (adapter_config.json + adapter_model.safetensors), or
  for full fine-tuning a Hugging Face model directory (config.json, model.safetensors, tokenizer files),
  which transformers / PEFT load as is.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skyrl_tx.checkpoints.peft_experts import fuse_experts, needs_fused_experts, unfuse_experts
from skyrl_tx.checkpoints.tensor_files import TensorFile
from skyrl_tx.errors import InvalidArgumentError

if TYPE_CHECKING:  # the API imports ModelMeta from here and must not load torch (only the engine does)
    import torch


def load_safetensors(raw: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(raw)



FORMAT_VERSION = 1
STATE_FILE = "skyrl_state.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_WEIGHTS = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
# Files copied from the base model into a full Hugging Face export, so it loads (and tokenizes) on its own.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")
# Attention also names MLA's projections (DeepSeek V3) and the Gated DeltaNet's (Qwen3.5's linear attention); PEFT
# ignores target names a model does not have.
TARGET_GROUPS = {"train_attn": ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                "kv_b_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
                 "train_mlp": ("gate_proj", "up_proj", "down_proj"),
                 "train_unembed": ("lm_head",)}

ReadFile = Callable[[str], bytes]  # file name in the checkpoint directory → its bytes
# A file to publish: small ones as bytes, tensors as a TensorFile streamed into the store (CheckpointStore.publish).
FileData = bytes | TensorFile


@dataclass(frozen=True)
class ModelMeta:
    """What a checkpoint needs to be loaded again: the model's shape, not its values."""

    base_model: str
    lora_rank: int  # 0 = full fine-tuning
    lora_alpha: float
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None
    optimizer_step: int = 0
    optimizer: str = "adamw"  # the model's optimizer family ("adamw" | "dimuon"), fixed for its life

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0

    def to_json(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ModelMeta:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in fields})

    def target_modules(self) -> list[str]:
        return [m for flag, modules in TARGET_GROUPS.items() if getattr(self, flag) for m in modules]


def json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def peft_adapter_config(meta: ModelMeta, tensor_names: Iterable[str] = ()) -> dict[str, Any]:
    """tensor_names: the adapter's PEFT tensor names; an adapter with per-expert MoE factors gets the targets
    transformers 5 + PEFT load it with (_fused_expert_targets)."""
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": meta.base_model,
              "r": meta.lora_rank, "lora_alpha": meta.lora_alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": meta.target_modules(), "fan_in_fan_out": False, "inference_mode": True,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None}
    return config | _fused_expert_targets(meta, list(tensor_names))


_EXPERT_FACTOR = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.lora_A\.weight$")
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _fused_expert_targets(meta: ModelMeta, names: list[str]) -> dict[str, Any]:
    """Targets of an adapter with expert factors, for transformers 5 + PEFT (0.21). transformers 5 keeps a layer's
    experts as two 3-D parameters, mlp.experts.gate_up_proj [E, 2 * I, H] and mlp.experts.down_proj [E, H, I]; PEFT
    adapts them as target_parameters and, on loading, fuses the saved per-expert factors
    (`...experts.{e}.gate_proj.lora_A.weight`, the hub checkpoints' names, kept as they are) into them: gate and up
    side by side, so rank and alpha double there (rank_pattern / alpha_pattern; alpha / r is unchanged). A module
    name such as gate_proj in target_modules would make PEFT move it to the fused experts, leaving the MLPs that are
    plain nn.Linear modules (dense layers, shared experts) without their adapter: those are named as parameters
    (`mlp.gate_proj.weight`, `mlp.shared_experts.gate_proj.weight`), which PEFT adapts exactly as a LoRA module.
    {} for an adapter without expert factors (dense models, train_mlp=False)."""
    if not any(_EXPERT_FACTOR.search(name) for name in names):
        return {}
    mlp = set(TARGET_GROUPS["train_mlp"])
    linear_mlps = set()
    for name in names:
        if not name.endswith(".lora_A.weight") or _EXPERT_FACTOR.search(name) or ".layers." not in name:
            continue
        module = name.removesuffix(".lora_A.weight")
        if module.rsplit(".", 1)[-1] in mlp:  # model.layers.{i}.<this>: e.g. mlp.shared_experts.gate_proj
            linear_mlps.add(module.split(".layers.", 1)[1].split(".", 1)[1] + ".weight")
    pattern = r".*\.gate_up_proj"  # the key PEFT's own conversion of such adapters writes
    return {"target_modules": [m for m in meta.target_modules() if m not in mlp] or None,
            "target_parameters": sorted(linear_mlps) + list(_FUSED_EXPERTS),
            "rank_pattern": {pattern: 2 * meta.lora_rank}, "alpha_pattern": {pattern: 2 * meta.lora_alpha}}


def optimizer_files(state: Any) -> dict[str, FileData]:
    """state: the extension's OptimizerState (kind, step, exp_avg, exp_avg_sq, momentum, master; float32, saved as
    is). master: AdamW's float32 master weights of a bfloat16 full fine-tune (the weights file holds their bf16
    rounding); empty for float32 weights and LoRA adapters."""
    tensors = {f"exp_avg.{k}": v for k, v in state.exp_avg.items()}
    tensors |= {f"exp_avg_sq.{k}": v for k, v in state.exp_avg_sq.items()}
    tensors |= {f"momentum.{k}": v for k, v in state.momentum.items()}
    tensors |= {f"master.{k}": v for k, v in state.master.items()}
    return {OPTIMIZER_FILE: TensorFile(tensors, metadata={"step": str(int(state.step)), "optimizer": state.kind})}


def read_optimizer(read: ReadFile) -> dict[str, Any]:
    """{kind, step, exp_avg, exp_avg_sq, momentum, master} (tensor names without their prefix); files written before
    Dimuon existed have no "optimizer" metadata and hold AdamW moments; files written before master weights existed
    (or from float32 weights) hold none: the backend rebuilds them from the loaded weights."""
    raw = read(OPTIMIZER_FILE)
    tensors = load_safetensors(raw)
    metadata = _safetensors_metadata(raw)
    out: dict[str, Any] = {"kind": metadata.get("optimizer", "adamw"), "step": int(metadata.get("step", "0"))}
    for part in ("exp_avg", "exp_avg_sq", "momentum", "master"):
        out[part] = {k.removeprefix(f"{part}."): v for k, v in tensors.items() if k.startswith(f"{part}.")}
    return out


def _safetensors_metadata(raw: bytes) -> dict[str, str]:
    # safetensors layout: 8-byte little-endian header length, then the JSON header with "__metadata__".
    header_len = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + header_len]).get("__metadata__", {}) or {}


def adapter_files(meta: ModelMeta, peft_state: dict[str, torch.Tensor]) -> dict[str, FileData]:
    """peft_state: PEFT-named factors ('base_model.model.<module>.lora_A.weight'; float32 masters). Expert factors
    of a Qwen3.5 MoE vision-language checkpoint are written fused (peft_experts: PEFT cannot fuse them there)."""
    config = json_bytes(peft_adapter_config(meta, peft_state))
    if needs_fused_experts(peft_state):
        peft_state = fuse_experts(peft_state)
    return {ADAPTER_CONFIG: config, ADAPTER_WEIGHTS: TensorFile(peft_state)}


def trainable_files(meta: ModelMeta, state: dict[str, torch.Tensor],
                    dtype: torch.dtype | None = None) -> dict[str, FileData]:
    """The trainable tensors as read_weights reads them back: a PEFT adapter, or HF-named model.safetensors
    (full fine-tuning weights written in `dtype`, the model's, when given)."""
    if meta.is_lora:
        return adapter_files(meta, state)
    return {MODEL_WEIGHTS: TensorFile(state, cast_to=dtype)}


def hf_model_files(base_model_dir: Path, weights: dict[str, torch.Tensor],
                   dtype: torch.dtype | None = None) -> dict[str, FileData]:
    """A Hugging Face model directory: the base model's config and tokenizer files + these weights (HF text-model
    names; written in `dtype` when given, else as they are). Of a vision-language base (Qwen3.5 on the hub) it is
    that checkpoint again: the weights under model.language_model.*, its other tensors copied as they are."""
    files: dict[str, FileData] = {name: (base_model_dir / name).read_bytes() for name in HF_SIDE_FILES
                                  if (base_model_dir / name).is_file()}
    config = json.loads(files.get("config.json", b"{}"))
    if config.pop("quantization_config", None) is not None:  # an FP8 base, dequantised at load: not FP8 any more
        files["config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    from skyrl_tx.models.checkpoint import as_stored_name, not_served_tensors, stored_text_prefix

    prefix = stored_text_prefix(base_model_dir)
    if prefix != "model.":  # a vision-language base: its names, and the vision tower (and mtp.*) carried over
        weights = {as_stored_name(k, prefix): v for k, v in weights.items()} | not_served_tensors(base_model_dir)
    files[MODEL_WEIGHTS] = TensorFile(weights, cast_to=dtype)
    return files


def write_directory(out_dir: Path, files: dict[str, FileData]) -> None:
    """Writes `files` into an existing local directory (exports that bypass the checkpoint store)."""
    for name, data in files.items():
        with open(out_dir / name, "wb") as out:
            if isinstance(data, TensorFile):
                data.write_to(out)
            else:
                out.write(data)


def read_meta(read: ReadFile) -> ModelMeta:
    try:
        raw = json.loads(read(STATE_FILE))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"checkpoint: {STATE_FILE} is not valid JSON ({exc})") from exc
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise InvalidArgumentError(f"checkpoint: format version {raw['format_version']} is newer than this server "
                                   f"understands ({FORMAT_VERSION}); upgrade skyrl_tx")
    return ModelMeta.from_json(raw)


def read_weights(read: ReadFile, meta: ModelMeta) -> dict[str, torch.Tensor]:
    """Trainable tensors: PEFT-named factors for LoRA (expert factors per expert), HF-named parameters for full
    fine-tuning."""
    if meta.is_lora:
        return unfuse_experts(load_safetensors(read(ADAPTER_WEIGHTS)), meta.lora_rank)
    return load_safetensors(read(MODEL_WEIGHTS))
