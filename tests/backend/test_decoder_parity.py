"""The C++ decoder's target-token logprobs equal transformers (base) and PEFT (LoRA) on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import hf_token_logprobs, load_hf_model, peft_state_dict, random_peft_model

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.models.tiny_presets import generate_model

PRESETS = ["tiny-qwen3", "tiny-qwen3-tied", "tiny-llama3"]
LENGTHS = [2, 7, 33, 96]
ATOL = 1e-5


def sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def ours(backend: NativeBackend, seqs: list[list[int]], adapters: list[str] | None = None) -> list[torch.Tensor]:
    return backend.token_logprobs([s[:-1] for s in seqs], [s[1:] for s in seqs], adapters)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest, tiny_model_dir) -> tuple[Path, NativeBackend]:
    path = tiny_model_dir(request.param)
    return path, NativeBackend(path, BackendSettings(max_lora_adapters=4, max_lora_rank=8))


def test_base_logprobs_match_transformers(preset) -> None:
    path, backend = preset
    hf = load_hf_model(path)
    seqs = sequences(backend.decoder_config.vocab_size, LENGTHS)
    for seq, got in zip(seqs, ours(backend, seqs)):
        assert_close(got, hf_token_logprobs(hf, seq))


def test_padded_batch_equals_each_sequence_alone(preset) -> None:
    _, backend = preset
    seqs = sequences(backend.decoder_config.vocab_size, [5, 40, 1 + 1, 17], seed=1)
    batched = ours(backend, seqs)
    for seq, got in zip(seqs, batched):
        assert_close(got, ours(backend, [seq])[0])


def test_lora_adapter_matches_peft(preset) -> None:
    path, backend = preset
    peft_model = random_peft_model(path, rank=4, alpha=8.0, seed=3)
    backend.create_adapter("peft-a", rank=4, alpha=8.0)
    try:
        backend.set_adapter_weights("peft-a", peft_state_dict(peft_model))
        seqs = sequences(backend.decoder_config.vocab_size, LENGTHS, seed=2)
        got = ours(backend, seqs, ["peft-a"] * len(seqs))
        for seq, lp in zip(seqs, got):
            assert_close(lp, hf_token_logprobs(peft_model, seq))
        # The adapter really changes the output, so the check above is not the base model again.
        assert (got[-1] - ours(backend, seqs[-1:])[0]).abs().max() > 1e-3
    finally:
        backend.remove_adapter("peft-a")


def test_fresh_adapter_equals_base(preset) -> None:
    _, backend = preset
    backend.create_adapter("fresh", rank=8, alpha=16.0, seed=7)
    try:
        seqs = sequences(backend.decoder_config.vocab_size, [9, 30], seed=4)
        for base, adapted in zip(ours(backend, seqs), ours(backend, seqs, ["fresh", "fresh"])):
            assert torch.equal(base, adapted)
    finally:
        backend.remove_adapter("fresh")


def test_mixed_adapter_batch_equals_rows_alone(preset) -> None:
    path, backend = preset
    models = {"x": random_peft_model(path, rank=2, alpha=4.0, seed=10),
              "y": random_peft_model(path, rank=8, alpha=8.0, seed=11, target_modules=["q_proj", "k_proj",
                                                                                       "v_proj", "o_proj"])}
    backend.create_adapter("x", rank=2, alpha=4.0)
    backend.create_adapter("y", rank=8, alpha=8.0, train_mlp=False, train_unembed=False)
    try:
        for name, model in models.items():
            backend.set_adapter_weights(name, peft_state_dict(model))
        seqs = sequences(backend.decoder_config.vocab_size, [12, 5, 30, 8, 19], seed=5)
        adapters = ["y", "", "x", "y", "x"]
        batched = ours(backend, seqs, adapters)
        for seq, adapter, got in zip(seqs, adapters, batched):
            assert_close(got, ours(backend, [seq], [adapter])[0])
            reference = models[adapter] if adapter else load_hf_model(path)
            assert_close(got, hf_token_logprobs(reference, seq))
    finally:
        backend.remove_adapter("x")
        backend.remove_adapter("y")


def test_sharded_checkpoint_and_small_chunks_give_same_logprobs(tmp_path: Path, preset) -> None:
    path, backend = preset
    name = path.name.rsplit("-v", 1)[0]
    sharded = generate_model(name, tmp_path / "sharded", max_shard_size="200KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    chunked = NativeBackend(sharded, BackendSettings(logprobs_chunk_tokens=3))
    seqs = sequences(backend.decoder_config.vocab_size, [11, 4], seed=6)
    for a, b in zip(ours(backend, seqs), ours(chunked, seqs)):
        assert_close(a, b, atol=1e-6)


def test_bfloat16_compute_tracks_float32(preset) -> None:
    path, backend = preset
    bf16 = NativeBackend(path, BackendSettings(dtype="bfloat16"))
    seqs = sequences(backend.decoder_config.vocab_size, [20], seed=8)
    got, ref = ours(bf16, seqs)[0], ours(backend, seqs)[0]
    assert got.dtype == torch.float32
    # bf16 has ~3 significant digits; logprobs of a ~2k vocab are ~-7.7.
    assert_close(got, ref, atol=0.1)


def test_peft_directory_loads_and_matches(tmp_path: Path, preset) -> None:
    path, backend = preset
    peft_model = random_peft_model(path, rank=3, alpha=6.0, seed=12)
    peft_model.save_pretrained(tmp_path / "adapter")  # adapter_config.json + adapter_model.safetensors
    backend.load_peft_adapter("from-dir", tmp_path / "adapter")
    try:
        seqs = sequences(backend.decoder_config.vocab_size, [15], seed=9)
        assert_close(ours(backend, seqs, ["from-dir"])[0], hf_token_logprobs(peft_model, seqs[0]))
    finally:
        backend.remove_adapter("from-dir")
