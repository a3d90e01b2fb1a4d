"""Reference log-probabilities from Hugging Face transformers (+ PEFT) for the parity tests."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def load_hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    # eager attention: an implementation independent of the SDPA call the C++ core makes.
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()


@torch.no_grad()
def hf_token_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t+1] | tokens[:t+1]) for t < len-1: [len - 1] float32, one unpadded sequence."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0, :-1].float()  # [len - 1, vocab]
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)


def random_peft_model(model_dir: Path, *, rank: int, alpha: float, seed: int,
                      target_modules: list[str] = ALL_LINEAR) -> torch.nn.Module:
    """A PEFT LoRA model whose A and B are both random and nonzero (a fresh adapter would equal the base)."""
    peft_model = get_peft_model(load_hf_model(model_dir),
                                LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return peft_model.eval()


def peft_state_dict(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """'base_model.model.<module>.lora_A.weight' → tensor, the adapter_model.safetensors naming."""
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()}
