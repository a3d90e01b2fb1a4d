"""Packed training sequences and packed sampling prefill on a GPU (GPU only): in bfloat16 the packed row runs flash
attention's varlen kernel (aten::_flash_attention_forward on [tokens, heads, D], one call per layer for all
sequences) and equals right-padded rows; in float32 it runs one SDPA call per run of equal-length sequences and
equals them tightly. Training: forward (logprobs) and backward (every LoRA gradient); sampling: prompt logprobs."""

from __future__ import annotations

import pytest
import torch
from cuda_backends import cuda_backend_with_adapters

from skyrl_tx.types import Datum, TrainRequest

pytestmark = pytest.mark.gpu

# Dense GQA (head_dim 16), the hybrid family (gated attention beside Gated DeltaNet layers) and MLA (q/k 24 wide,
# values 16: zero-padded for flash).
PRESETS = ["tiny-qwen3", "tiny-qwen3.5", "tiny-deepseek-v3"]
# dtype → (logprob tolerance, gradient tolerance relative to each tensor's largest entry)
TOLERANCES = {"bfloat16": (0.05, 0.05), "float32": (1e-4, 1e-4)}


def _varlen_flash_calls(prof: torch.profiler.profile) -> int:
    """Calls of flash attention's varlen kernel: aten::_flash_attention_forward on 3-d [tokens, heads, D] queries.
    (SDPA's flash backend, which padded rows may take in bf16, calls the same op on 4-d [B, T, heads, D] ones.)"""
    return sum(e.count for e in prof.key_averages(group_by_input_shape=True)
               if e.key == "aten::_flash_attention_forward" and e.input_shapes and len(e.input_shapes[0]) == 3)


def _requests(vocab: int) -> list[TrainRequest]:
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (33, 130, 9, 65)]
    data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]
    return [TrainRequest("a", data[:3]), TrainRequest("b", data[3:])]


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("preset", PRESETS)
def test_packed_rows_equal_padded_rows_on_cuda(tiny_model_dir, preset: str, dtype: str, capfd) -> None:
    flash = dtype == "bfloat16" and torch.cuda.get_device_capability()[0] >= 8
    path = tiny_model_dir(preset)
    results = {}
    for packed in (True, False):
        backend = cuda_backend_with_adapters(path, dtype=dtype, train_packed_sequences=packed)
        requests = _requests(backend.decoder_config.vocab_size)
        with torch.profiler.profile(record_shapes=True) as prof:
            out = backend.forward_backward(requests)
        calls = _varlen_flash_calls(prof)
        assert (calls > 0) == (packed and flash), (packed, dtype, calls)
        results[packed] = (out, {m: backend.trainable_grads(m) for m in ("a", "b")})
    # A failed flash call falls back to SDPA with a warning (packed_attention.cpp): here that is a failure.
    assert "varlen kernel failed" not in capfd.readouterr().err
    lp_tol, grad_tol = TOLERANCES[dtype]
    (out_p, grads_p), (out_q, grads_q) = results[True], results[False]
    for got, ref in zip(out_p, out_q):
        for a, b in zip(got.loss_fn_outputs, ref.loss_fn_outputs):
            assert (a["logprobs"].float() - b["logprobs"].float()).abs().max().item() <= lp_tol
    for model in ("a", "b"):
        for name, ref in grads_q[model].items():
            scale = ref.abs().max().item()
            assert (grads_p[model][name].float() - ref.float()).abs().max().item() <= grad_tol * scale + 1e-6, name


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("preset", PRESETS)
def test_packed_prefill_equals_padded_rows_on_cuda(tiny_model_dir, preset: str, dtype: str, capfd) -> None:
    """Sampling prefill (sample_packed_prefill): prompts of mixed lengths packed in one row take flash varlen in
    bfloat16 and score their prompts as padded prefill rows do; in float32 the greedy tokens agree too (the decode
    read the packed-written KV cache)."""
    from skyrl_tx.types import SampleRequest, SamplingParams

    flash = dtype == "bfloat16" and torch.cuda.get_device_capability()[0] >= 8
    path = tiny_model_dir(preset)
    results = {}
    for packed in (True, False):
        backend = cuda_backend_with_adapters(path, dtype=dtype, sample_packed_prefill=packed, prefix_caching=False)
        gen = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, backend.decoder_config.vocab_size, (n,), generator=gen).tolist()
                   for n in (33, 130, 9, 65)]
        requests = [SampleRequest(p, SamplingParams(max_tokens=4, temperature=0.0, stop=[]), weights_id=w,
                                  prompt_logprobs=True) for p, w in zip(prompts, ("a", "b", "", "a"))]
        with torch.profiler.profile(record_shapes=True) as prof:
            results[packed] = backend.sample(requests)
        calls = _varlen_flash_calls(prof)
        assert (calls > 0) == (packed and flash), (packed, dtype, calls)
    assert "varlen kernel failed" not in capfd.readouterr().err
    lp_tol = TOLERANCES[dtype][0]
    for got, ref in zip(results[True], results[False]):
        diff = (torch.tensor(got.prompt_logprobs[1:]) - torch.tensor(ref.prompt_logprobs[1:])).abs().max().item()
        assert diff <= lp_tol, diff
        if dtype == "float32":
            assert got.sequences[0].tokens == ref.sequences[0].tokens
