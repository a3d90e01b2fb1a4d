"""Hugging Face references for MoE models with a LoRA adapter merged in (W + scale * B @ A on every linear, experts
included), differentiable in the factors: transformers 5 keeps experts as fused 3-D parameters, which PEFT's
per-module LoRA cannot wrap, so the adapter is applied by functional_call on merged weights instead."""

from __future__ import annotations

import re

import torch
from torch.func import functional_call

PEFT_PREFIX = "base_model.model."
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def module_deltas(factors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """PEFT-named factors → {module: scale * B @ A} (module names without the PEFT prefix)."""
    deltas = {}
    for name, a in factors.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        b = factors[name.replace(".lora_A.", ".lora_B.")]
        deltas[module] = scale * (b @ a)  # [out, in]
    return deltas


def merged_parameters(hf: torch.nn.Module, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF parameter name → base weight + delta, for every parameter an adapted module touches (fused experts too)."""
    params = dict(hf.named_parameters())
    merged: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for module, delta in deltas.items():
        m = _EXPERT.match(module)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = delta
            continue
        name = "lm_head.weight" if module == "lm_head" else module + ".weight"
        if name not in params and module == "lm_head":  # tied: the head is the embedding
            name = "model.embed_tokens.weight"
        merged[name] = params[name] + delta
    for prefix, per_expert in experts.items():
        gate_up, down = params[prefix + ".gate_up_proj"], params[prefix + ".down_proj"]  # [E, 2I, H], [E, H, I]
        zero_gu, zero_d = torch.zeros_like(gate_up[0]), torch.zeros_like(down[0])
        inter = gate_up.shape[1] // 2
        gu_delta, d_delta = [], []
        for e in range(gate_up.shape[0]):
            d = per_expert.get(e, {})
            gu = zero_gu
            if "gate_proj" in d or "up_proj" in d:  # fused rows: gate first, then up (chunk(2) in transformers)
                gu = torch.cat([d.get("gate_proj", zero_gu[:inter]), d.get("up_proj", zero_gu[inter:])], 0)
            gu_delta.append(gu)
            d_delta.append(d.get("down_proj", zero_d))
        merged[prefix + ".gate_up_proj"] = gate_up + torch.stack(gu_delta)
        merged[prefix + ".down_proj"] = down + torch.stack(d_delta)
    return merged


class MergedLoraModel(torch.nn.Module):
    """`hf` with the LoRA factors (leaf parameters, PEFT names in `.factors`) merged into its weights on every call."""

    def __init__(self, hf: torch.nn.Module, factors: dict[str, torch.Tensor], scale: float):
        super().__init__()
        self.hf = hf.eval()
        for p in self.hf.parameters():
            p.requires_grad_(False)
        self.scale = scale
        self.factors = {k: torch.nn.Parameter(v.detach().clone().float()) for k, v in factors.items()}

    def forward(self, **kwargs):
        return functional_call(self.hf, merged_parameters(self.hf, module_deltas(self.factors, self.scale)), (),
                               kwargs, strict=False)


def expert_factor_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in state if ".mlp.experts." in k]


@torch.no_grad()
def merge_into(hf: torch.nn.Module, factors: dict[str, torch.Tensor], scale: float) -> torch.nn.Module:
    """`hf` with the adapter merged into its weights in place (a plain HF model again: generate() works)."""
    params = dict(hf.named_parameters())
    for name, value in merged_parameters(hf, module_deltas(factors, scale)).items():
        params[name].copy_(value)
    return hf
