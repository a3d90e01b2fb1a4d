"""MoE experts on a GPU (GPU only): grouped GEMMs over stacked expert weights (grouped_expert_gemm "auto" on compute
capability >= 9.0, "always" from 8.0) compute what one matmul chain per expert computes, forward and backward."""

from __future__ import annotations

import pytest
import torch
from cuda_backends import cuda_backend_with_adapters

from skyrl_tx.types import Datum, TrainRequest

pytestmark = pytest.mark.gpu

PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3"]


def _requests(vocab: int) -> list[TrainRequest]:
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (33, 70, 9)]
    data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]
    return [TrainRequest("a", data[:2]), TrainRequest("b", data[2:])]


@pytest.mark.parametrize("preset", PRESETS)
def test_grouped_expert_gemms_equal_per_expert_matmuls(tiny_model_dir, preset: str) -> None:
    major = torch.cuda.get_device_capability()[0]
    if major < 8:
        pytest.skip("libtorch's grouped GEMM needs compute capability >= 8.0")
    path = tiny_model_dir(preset)
    grouped_policy = "auto" if major >= 9 else "always"
    results = {}
    for policy in (grouped_policy, "never"):
        backend = cuda_backend_with_adapters(path, grouped_expert_gemm=policy)
        requests = _requests(backend.decoder_config.vocab_size)
        with torch.profiler.profile() as prof:
            out = backend.forward_backward(requests)
        calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_grouped_mm")
        assert (calls > 0) == (policy != "never"), (policy, calls)
        results[policy] = (out, {m: backend.trainable_grads(m) for m in ("a", "b")})
    (out_g, grads_g), (out_l, grads_l) = results[grouped_policy], results["never"]
    for got, ref in zip(out_g, out_l):
        for a, b in zip(got.loss_fn_outputs, ref.loss_fn_outputs):
            # bf16 products summed in another order; a near-tied routing choice may flip (logprobs ~ -7.7).
            assert (a["logprobs"].float() - b["logprobs"].float()).abs().max().item() <= 0.05
    for model in ("a", "b"):
        for name, ref in grads_l[model].items():
            scale = ref.abs().max().item()
            assert (grads_g[model][name].float() - ref.float()).abs().max().item() <= 0.05 * scale + 1e-6, name
