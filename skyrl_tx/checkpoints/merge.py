"""merge_adapter: base model + PEFT LoRA adapter → one Hugging Face model directory (W + alpha/r · B·A)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from skyrl_tx.backend.native_convert import PEFT_PREFIX
from skyrl_tx.checkpoints.formats import ADAPTER_CONFIG, ADAPTER_WEIGHTS, hf_model_files, write_directory
from skyrl_tx.checkpoints.peft_experts import unfuse_experts
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.models.checkpoint import load_weights, text_model_weight_name


MERGE_ROWS = 4096  # rows merged at a time: a float32 block of [4096, in], not a float32 copy of the whole tensor


def _add_product_(weight: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scaling: float) -> None:
    """weight [out, in] += scaling * lora_b [out, r] @ lora_a [r, in], in place, each block of rows computed in
    float32 and rounded once to weight's dtype (an unembedding of 128K-248K rows would need three float32 copies)."""
    for start in range(0, weight.shape[0], MERGE_ROWS):
        block = weight[start:start + MERGE_ROWS]  # a view: written in place
        block.copy_(block.float().addmm_(lora_b[start:start + MERGE_ROWS], lora_a, alpha=scaling))


def merge_adapter(base_model_dir: Path, adapter_dir: Path, out_dir: Path) -> list[str]:
    """Writes the merged model to out_dir (created; must not exist). Returns the merged module names.

    The merge runs in float32 and is saved in the base weights' dtype. A tied model whose lm_head is
    adapted gets its own lm_head.weight and `tie_word_embeddings: false` (the embedding stays unchanged)."""
    base_model_dir, adapter_dir, out_dir = Path(base_model_dir), Path(adapter_dir), Path(out_dir)
    if out_dir.exists():
        raise InvalidArgumentError(f"export: {out_dir} already exists; pick a new directory")
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    scaling = float(config["lora_alpha"]) / float(config["r"])
    factors = unfuse_experts(load_file(str(adapter_dir / ADAPTER_WEIGHTS)), int(config["r"]))
    weights = load_weights(base_model_dir)
    model_config = json.loads((base_model_dir / "config.json").read_text())
    # An FP8 base (DeepSeek V3 as published) was dequantised by load_weights: the merged copy is not quantised.
    model_config.pop("quantization_config", None)
    merged = []
    for a_name in sorted(k for k in factors if k.endswith(".lora_A.weight")):
        # the text model's name (an adapter of a vision-language base is named model.language_model.*)
        module = text_model_weight_name(a_name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")) or a_name
        lora_a = factors[a_name].float()  # [r, in]
        lora_b = factors[a_name.replace(".lora_A.", ".lora_B.")].float()  # [out, r]
        target = f"{module}.weight"
        if target not in weights and module == "lm_head" and model_config.get("tie_word_embeddings"):
            weights[target] = weights["model.embed_tokens.weight"].clone()  # untie: only the head changes
            model_config["tie_word_embeddings"] = False
        if target not in weights:
            raise InvalidArgumentError(f"export: the adapter adapts {module}, which the base model does not have")
        _add_product_(weights[target], lora_b, lora_a, scaling)
        merged.append(module)
    files = hf_model_files(base_model_dir, weights)
    files["config.json"] = (json.dumps(model_config, indent=2) + "\n").encode()
    out_dir.mkdir(parents=True)
    write_directory(out_dir, files)
    return merged
