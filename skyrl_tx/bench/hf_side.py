"""The Hugging Face transformers + PEFT side of each workload: the usual training loop and `generate` (SDPA)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from skyrl_tx.bench import workloads as wl
from skyrl_tx.bench.configs import BenchConfig

# skyrl_tx's set (checkpoints/formats.py TARGET_GROUPS); the DeltaNet's projections match only Qwen3.5 models.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
           "gate_proj", "up_proj", "down_proj", "lm_head"]


def preload() -> None:
    """Imports everything lazily imported later (transformers loads model code on first use) before the baseline."""
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401
    from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401


def _peft_model(model_dir: Path, cfg: BenchConfig, device: str, adapters: int):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    rank = cfg.workload.lora_rank
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.dtype),
                                                attn_implementation="sdpa").to(device)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, lora, adapter_name="adapter-0")
    for i in range(1, adapters):
        model.add_adapter(f"adapter-{i}", lora)
    for i in range(adapters):
        name = f"adapter-{i}"
        shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model, adapter_name=name,
                                                                        save_embedding_layers=False).items()}
        factors = {k: v.to(device) for k, v in wl.random_lora_factors(shapes, seed=i + 1).items()}
        set_peft_model_state_dict(model, factors, adapter_name=name)
    return model


def _adapter_params(model, name: str) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n]


def build(workload: str, model_dir: Path, cfg: BenchConfig, device: str,
          new_tokens: int | None = None) -> wl.Prepared:
    """The same work as skyrl_side.build."""
    if wl.is_training(workload):
        return _build_train(workload, model_dir, cfg, device)
    return _build_sample(workload, model_dir, cfg, device, new_tokens)


def _build_train(workload: str, model_dir: Path, cfg: BenchConfig, device: str):
    data = wl.train_data(workload, cfg)
    adapters = len(data.per_adapter)
    model = _peft_model(model_dir, cfg, device, adapters).train()
    names = [f"adapter-{i}" for i in range(adapters)]
    for name in names:
        for p in _adapter_params(model, name):
            p.requires_grad_(True)
    optimizers = {name: torch.optim.AdamW(_adapter_params(model, name), lr=wl.LEARNING_RATE, betas=wl.BETAS,
                                          eps=wl.EPS, weight_decay=0.0) for name in names}
    blocks = [block.to(device) for block in data.per_adapter]

    def train_rep() -> None:
        # PEFT trains one adapter at a time: switch, forward/backward that adapter's request, step its optimizer.
        for name, block in zip(names, blocks):
            model.set_adapter(name)
            logits = model(input_ids=block[:, :-1]).logits  # [rows, T, vocab]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), block[:, 1:].flatten(),
                                                     reduction="sum")  # Tinker's sum semantics
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()

    return wl.Prepared(train_rep, data.tokens)


def _build_sample(workload: str, model_dir: Path, cfg: BenchConfig, device: str, new_tokens: int | None):
    data = wl.sample_data(workload, cfg, new_tokens)
    model = _peft_model(model_dir, cfg, device, 1).eval()
    prompts = data.prompts.to(device)
    generation = copy.deepcopy(model.generation_config)
    # Never stop early (skyrl_tx side: stop=[]); plain temperature-1 sampling, no top-k/top-p cut.
    generation.update(eos_token_id=None, pad_token_id=0, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                      max_new_tokens=data.new_tokens, min_new_tokens=None)
    first_token = copy.deepcopy(generation)
    first_token.update(max_new_tokens=1)
    counter = iter(range(1 << 30))

    def sample_rep(config=generation) -> None:
        torch.manual_seed(next(counter))
        with torch.inference_mode():
            out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
        if out.shape[1] != prompts.shape[1] + config.max_new_tokens:
            raise RuntimeError(f"HF generate produced {out.shape[1] - prompts.shape[1]} tokens per row, "
                               f"expected {config.max_new_tokens}")
        if device != "cpu":
            torch.cuda.synchronize()

    return wl.Prepared(sample_rep, data.tokens, lambda: sample_rep(first_token))
