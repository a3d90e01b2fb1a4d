"""MoE expert factors in PEFT's fused layout, for the one case PEFT cannot fuse them itself.

transformers 5 keeps a layer's experts as two 3-D parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj), which
PEFT adapts as target_parameters with one LoRA each, nested: the down_proj wrapper outside (`experts.lora_A/B`), the
gate_up_proj one inside it (`experts.base_layer.lora_A/B`). PEFT 0.21 fuses adapters saved per expert
(`experts.{e}.gate_proj.lora_A.weight`, the names every other export uses) into those on loading, through the model
type's weight-conversion mapping; Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe, the hub's Qwen3.5 and
Qwen3.6 MoE checkpoints) has none, so PEFT drops its expert factors. Adapters of such a checkpoint are written here in
the fused layout PEFT's conversion would produce, and read back to per-expert factors (the core's names).

Layouts (E experts, rank r, per expert A_x [r, in], B_x [out, r]), as in peft.utils.transformers_weight_conversion:
- gate_up lora_A [E * 2r, H]: per expert [A_gate; A_up]; lora_B [2I, 2r * E]: viewed [2I, 2r, E], expert e's
  block-diagonal [[B_gate, 0], [0, B_up]] (rank 2r, alpha 2 * alpha: adapter_config's rank/alpha_pattern).
- down lora_A [E * r, I]: the A_down stacked; lora_B [H, r * E]: viewed [H, r, E], expert e's B_down.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PEFT_VL_TEXT_PREFIX = "base_model.model.model.language_model."
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$")
_FUSED = {".base_layer.lora_A.weight": ("gate_up", "A"), ".base_layer.lora_B.weight": ("gate_up", "B"),
          ".lora_A.weight": ("down", "A"), ".lora_B.weight": ("down", "B")}


def needs_fused_experts(names) -> bool:
    """A vision-language checkpoint's adapter (Qwen3.5 MoE on the hub) with expert factors."""
    return any(n.startswith(PEFT_VL_TEXT_PREFIX) and _PER_EXPERT.match(n) for n in names)


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert factors -> PEFT's fused layout (other tensors unchanged)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[tuple[str, str], dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = tensor
            continue
        layers.setdefault(m.group(1), {}).setdefault((m.group(3), m.group(4)), {})[int(m.group(2))] = tensor
    for prefix, parts in layers.items():
        def stacked(proj: str, ab: str) -> torch.Tensor:
            by_expert = parts[(proj, ab)]
            return torch.stack([by_expert[e] for e in range(len(by_expert))])  # experts 0..E-1, all present

        a_gate, a_up, b_gate, b_up = (stacked("gate_proj", "A"), stacked("up_proj", "A"), stacked("gate_proj", "B"),
                                      stacked("up_proj", "B"))
        experts, rank, hidden = a_gate.shape
        inter = b_gate.shape[1]
        out[prefix + ".base_layer.lora_A.weight"] = torch.cat([a_gate, a_up], 1).reshape(experts * 2 * rank, hidden)
        block = a_gate.new_zeros(experts, 2 * inter, 2 * rank)
        block[:, :inter, :rank], block[:, inter:, rank:] = b_gate, b_up
        out[prefix + ".base_layer.lora_B.weight"] = block.permute(1, 2, 0).reshape(2 * inter, 2 * rank * experts)
        a_down, b_down = stacked("down_proj", "A"), stacked("down_proj", "B")
        out[prefix + ".lora_A.weight"] = a_down.reshape(experts * rank, inter)
        out[prefix + ".lora_B.weight"] = b_down.permute(1, 2, 0).reshape(b_down.shape[1], rank * experts)
    return {k: v.contiguous() for k, v in out.items()}


def unfuse_experts(state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """fuse_experts' inverse (rank: the adapter's r); a state without fused expert factors is returned as it is."""
    fused = {}
    for name in state:
        if _PER_EXPERT.match(name):
            continue
        for suffix, part in _FUSED.items():
            if name.endswith(".mlp.experts" + suffix):
                fused.setdefault(name.removesuffix(suffix), {})[part] = state[name]
                break
    if not fused:
        return state
    out = {k: v for k, v in state.items()
           if not any(k.removesuffix(s) in fused and k.endswith(s) for s in _FUSED)}
    for prefix, parts in fused.items():
        a, b = parts[("gate_up", "A")], parts[("gate_up", "B")]
        experts = a.shape[0] // (2 * rank)
        a = a.reshape(experts, 2 * rank, a.shape[1])
        inter = b.shape[0] // 2
        b = b.reshape(2 * inter, 2 * rank, experts).permute(2, 0, 1)  # [E, 2I, 2r]
        a_down, b_down = parts[("down", "A")], parts[("down", "B")]
        a_down = a_down.reshape(experts, rank, a_down.shape[1])
        b_down = b_down.reshape(b_down.shape[0], rank, experts).permute(2, 0, 1)  # [E, H, r]
        for e in range(experts):
            p = f"{prefix}.{e}."
            out[p + "gate_proj.lora_A.weight"], out[p + "up_proj.lora_A.weight"] = a[e, :rank], a[e, rank:]
            out[p + "gate_proj.lora_B.weight"] = b[e, :inter, :rank]
            out[p + "up_proj.lora_B.weight"] = b[e, inter:, rank:]
            out[p + "down_proj.lora_A.weight"], out[p + "down_proj.lora_B.weight"] = a_down[e], b_down[e]
    return {k: v.contiguous() for k, v in out.items()}
