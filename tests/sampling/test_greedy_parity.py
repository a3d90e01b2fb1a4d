"""Greedy sampling equals transformers generate(do_sample=False), for the base model and a PEFT LoRA adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_reference import load_hf_model, peft_state_dict, random_peft_model
from sampling_reference import assert_greedy_matches, greedy_requests, hf_greedy, random_prompts

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import SampledSequence

PRESETS = ["tiny-qwen3", "tiny-llama3"]
LENGTHS = [1, 4, 13, 37]  # one batch of different prompt lengths (padding in prefill, ragged decode)
MAX_NEW = 20


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[Path, NativeBackend]:
    path = tiny_model_dir(request.param)
    return path, NativeBackend(path, BackendSettings(max_lora_adapters=2, max_lora_rank=8))


def check_against_hf(model, backend: NativeBackend, prompts: list[list[int]], got: list[SampledSequence],
                     what: str) -> int:
    compared = 0
    for i, (prompt, seq) in enumerate(zip(prompts, got)):
        ref = hf_greedy(model, prompt, MAX_NEW, backend.eos_token_ids)
        n = assert_greedy_matches(seq.tokens, ref, model, prompt, f"{what} prompt {i}")
        compared += n
        assert len(seq.logprobs) == len(seq.tokens)
        if n == len(ref):  # no near-tie divergence: the stop reason must follow too
            if ref and ref[-1] in backend.eos_token_ids and len(ref) <= MAX_NEW:
                assert seq.stop_reason == "stop", f"{what} prompt {i}: HF stopped at EOS, ours {seq.stop_reason}"
            else:
                assert len(seq.tokens) == MAX_NEW and seq.stop_reason == "length", f"{what} prompt {i}"
    return compared


def test_base_greedy_batch_matches_transformers(preset) -> None:
    path, backend = preset
    hf = load_hf_model(path)
    prompts = random_prompts(backend.decoder_config.vocab_size, LENGTHS, seed=0, avoid=backend.eos_token_ids)
    results = backend.sample(greedy_requests(prompts, MAX_NEW))
    assert len(results) == len(prompts)
    got = [r.sequences[0] for r in results]
    compared = check_against_hf(hf, backend, prompts, got, "base")
    # Near-tie escapes are rare; most of the tokens must have been compared exactly.
    assert compared >= 0.75 * len(prompts) * MAX_NEW, f"only {compared} tokens compared"


def test_lora_greedy_batch_matches_peft(preset) -> None:
    path, backend = preset
    peft_model = random_peft_model(path, rank=4, alpha=8.0, seed=5)
    hf = load_hf_model(path)
    backend.create_model("greedy-lora", lora_rank=4, alpha=8.0)
    try:
        backend.set_adapter_weights("greedy-lora", peft_state_dict(peft_model))
        prompts = random_prompts(backend.decoder_config.vocab_size, LENGTHS, seed=1, avoid=backend.eos_token_ids)
        # One batch: every prompt with the adapter, interleaved with the same prompts on the base model.
        requests = []
        for p in prompts:
            requests += greedy_requests([p], MAX_NEW, "greedy-lora") + greedy_requests([p], MAX_NEW)
        results = backend.sample(requests)
        adapted = [r.sequences[0] for r in results[0::2]]
        base = [r.sequences[0] for r in results[1::2]]
        compared = check_against_hf(peft_model, backend, prompts, adapted, "lora")
        compared += check_against_hf(hf, backend, prompts, base, "base in mixed batch")
        assert compared >= 0.75 * 2 * len(prompts) * MAX_NEW, f"only {compared} tokens compared"
        # The adapter really changes the greedy output (so the LoRA check is not the base model again).
        assert any(a.tokens != b.tokens for a, b in zip(adapted, base))
    finally:
        backend.remove_model("greedy-lora")
