"""The CUDA path computes what the CPU path computes: logprobs, gradients, AdamW steps, sampling (GPU only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import AdamParams, Datum, SampleRequest, SamplingParams, TrainRequest

pytestmark = pytest.mark.gpu

RANK, ALPHA = 4, 8.0


def _sequences(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _random_factors(backend: NativeBackend, adapter: str, seed: int) -> dict[str, torch.Tensor]:
    """Nonzero A and B (a fresh adapter's B = 0 would hide a wrong LoRA path)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in sorted(backend.adapter_state_dict(adapter).items())}


def _pair(path: Path, **settings) -> tuple[NativeBackend, NativeBackend]:
    """The same model and adapters ("a", "b", "c") on the CPU (float32) and on the GPU (`settings`)."""
    common = {"max_lora_adapters": 3, "max_lora_rank": 8, "max_sampling_sequences": 8, "max_sampling_length": 128}
    cpu = NativeBackend(path, BackendSettings(**common))
    gpu = NativeBackend(path, BackendSettings(**{**common, "device": "cuda", **settings}))
    for i, name in enumerate(("a", "b", "c")):
        for backend in (cpu, gpu):
            backend.create_adapter(name, rank=RANK, alpha=ALPHA)
        factors = _random_factors(cpu, name, seed=10 + i)
        cpu.set_adapter_weights(name, factors)
        gpu.set_adapter_weights(name, factors)
    return cpu, gpu


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> Path:
    return tiny_model_dir("tiny-qwen3")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def test_float32_logprobs_match_cpu_for_mixed_adapter_batch(model_path: Path) -> None:
    cpu, gpu = _pair(model_path)
    seqs = _sequences(cpu.decoder_config.vocab_size, [9, 40, 3, 17], seed=1)
    adapters = ["a", "", "b", "c"]  # three adapters: the GPU's row-dense multi-adapter path
    inputs, targets = [s[:-1] for s in seqs], [s[1:] for s in seqs]
    for got, ref in zip(gpu.token_logprobs(inputs, targets, adapters), cpu.token_logprobs(inputs, targets, adapters)):
        assert got.shape == ref.shape
        assert _max_diff(got, ref) <= 1e-4


def test_float32_gradients_and_adam_step_match_cpu(model_path: Path) -> None:
    cpu, gpu = _pair(model_path)
    seqs = _sequences(cpu.decoder_config.vocab_size, [12, 30, 7], seed=2)

    def request(model: str) -> TrainRequest:
        return TrainRequest(model, [Datum(s[:-1], {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
                                    for s in seqs])

    results = {}
    for name, backend in (("cpu", cpu), ("gpu", gpu)):
        # Three adapters in one batch: the GPU takes the row-dense multi-adapter LoRA path, the CPU the segmented one.
        results[name] = backend.forward_backward([request("a"), request("b"), request("c")])
    for got, ref in zip(results["gpu"], results["cpu"]):
        for out_g, out_c in zip(got.loss_fn_outputs, ref.loss_fn_outputs):
            assert _max_diff(out_g["logprobs"], out_c["logprobs"]) <= 1e-4
    for adapter in ("a", "b", "c"):
        grads_g, grads_c = gpu.trainable_grads(adapter), cpu.trainable_grads(adapter)
        assert grads_g.keys() == grads_c.keys() and grads_c
        for key, ref in grads_c.items():
            scale = ref.abs().max().item() + 1e-6
            assert _max_diff(grads_g[key], ref) <= 1e-4 * scale, key
    params = AdamParams(learning_rate=1e-3, eps=1e-8)
    cpu.optim_step("a", params)
    gpu.optim_step("a", params)
    state_g, state_c = gpu.trainable_state("a"), cpu.trainable_state("a")
    for key, ref in state_c.items():
        # Adam's first step moves each weight by ~lr * sign(grad): compare with a fraction of lr.
        assert _max_diff(state_g[key], ref) <= 1e-4, key


def test_bfloat16_logprobs_track_cpu_float32(model_path: Path) -> None:
    cpu, gpu = _pair(model_path, dtype="bfloat16")
    seqs = _sequences(cpu.decoder_config.vocab_size, [25, 8], seed=3)
    inputs, targets = [s[:-1] for s in seqs], [s[1:] for s in seqs]
    for got, ref in zip(gpu.token_logprobs(inputs, targets, ["a", "b"]), cpu.token_logprobs(inputs, targets, ["a", "b"])):
        assert got.dtype == torch.float32
        assert _max_diff(got, ref) <= 0.1  # bf16 has ~3 significant digits; logprobs here are ~-7.7


def _sample_requests(vocab: int) -> list[SampleRequest]:
    prompts = _sequences(vocab, [5, 11, 3, 8], seed=4)
    weights = ["a", "b", "", "c"]
    return [SampleRequest(p, SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, stop=[]),
                          num_samples=2, weights_id=w, prompt_logprobs=True)
            for i, (p, w) in enumerate(zip(prompts, weights))]


def test_seeded_sampling_matches_cpu(model_path: Path) -> None:
    cpu, gpu = _pair(model_path)
    requests = _sample_requests(cpu.decoder_config.vocab_size)
    for got, ref in zip(gpu.sample(requests), cpu.sample(requests)):
        assert got.prompt_logprobs[0] is None and ref.prompt_logprobs[0] is None
        assert max(abs(g - r) for g, r in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:])) <= 1e-4
        for seq_g, seq_c in zip(got.sequences, ref.sequences):
            # Same seeded uniform draws on both devices: the same tokens unless a draw lands within ~1e-6 of a
            # CDF boundary, which 192 draws essentially never do.
            assert seq_g.tokens == seq_c.tokens
            assert max(abs(g - r) for g, r in zip(seq_g.logprobs, seq_c.logprobs)) <= 1e-4


def test_cuda_graph_decode_matches_eager_decode_and_follows_weight_updates(model_path: Path) -> None:
    """Captured decode graphs replay over live tensors: after the adapters change, replays use the new weights."""
    _, graphs = _pair(model_path)
    _, eager = _pair(model_path, cuda_graphs=False)
    requests = _sample_requests(graphs.decoder_config.vocab_size)

    def assert_same(got_all, ref_all) -> None:
        for got, ref in zip(got_all, ref_all):
            for seq_g, seq_e in zip(got.sequences, ref.sequences):
                assert seq_g.tokens == seq_e.tokens
                assert max(abs(g - r) for g, r in zip(seq_g.logprobs, seq_e.logprobs)) <= 1e-4

    assert_same(graphs.sample(requests), eager.sample(requests))
    new_factors = _random_factors(eager, "a", seed=77)
    for backend in (graphs, eager):
        backend.set_adapter_weights("a", new_factors)
        backend.remove_adapter("b")
        backend.create_adapter("b", rank=2, alpha=4.0)  # a different rank in the same slot
    factors_b = _random_factors(eager, "b", seed=78)
    for backend in (graphs, eager):
        backend.set_adapter_weights("b", factors_b)
    assert_same(graphs.sample(requests), eager.sample(requests))


def test_gpu_memory_utilization_sizes_the_kv_cache_within_the_fraction(model_path: Path) -> None:
    """The rows are what fits in the fraction of the device after the weights; the cache they make stays inside it,
    and sampling with them equals a fixed-row cache's."""
    from skyrl_tx.errors import InvalidArgumentError

    free, total = torch.cuda.mem_get_info()
    fraction = min(1.0, (total - free) / total + 0.02)  # ~2% of the device beyond what is in use: a few thousand rows
    settings = BackendSettings.from_dict({"device": "cuda", "max_sampling_length": 128,
                                          "gpu_memory_utilization": fraction})
    budgeted = NativeBackend(model_path, settings)
    rows = budgeted.settings.max_sampling_sequences
    assert rows > 16, rows
    prompt = _sequences(budgeted.decoder_config.vocab_size, [6], seed=1)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    got = budgeted.sample([SampleRequest(prompt, params)])[0].sequences[0].tokens
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after <= fraction * total + 64 * 2**20, (total - free_after, fraction * total)  # + workspace
    fixed = NativeBackend(model_path, BackendSettings(device="cuda", max_sampling_length=128))
    assert fixed.sample([SampleRequest(prompt, params)])[0].sequences[0].tokens == got
    with pytest.raises(InvalidArgumentError, match="less than one KV-cache row"):
        NativeBackend(model_path, BackendSettings.from_dict({"device": "cuda", "gpu_memory_utilization": 1e-6}))
