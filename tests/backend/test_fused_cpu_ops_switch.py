"""The fused CPU ops' switch (`_C._set_fused_cpu_ops`, which `bench gemm-share --fused-ab` flips between steps):
off, a training step runs ATen's SiLU; on, it runs the fused SwiGLU instead; the losses agree either way."""

from __future__ import annotations

import pytest

from skyrl_tx._ext import load_extension


def _profiled_step(backend, datums) -> tuple[float, set[str]]:
    from torch.profiler import ProfilerActivity, profile

    from skyrl_tx.types import TrainRequest

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = backend.forward_backward([TrainRequest("a", datums, "cross_entropy")])[0].metrics["loss:sum"]
    return loss, {e.key for e in prof.key_averages()}


def test_the_switch_chooses_fused_swiglu_or_the_aten_formula(tiny_model_dir) -> None:
    from train_reference import make_datums, our_logprobs, random_sequences

    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.config import BackendSettings

    native = load_extension()
    if not native._set_fused_cpu_ops(True):
        pytest.skip("this CPU has no AVX2 and FMA: the fused CPU ops never run")
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=1, max_lora_rank=4))
    backend.create_model("a", lora_rank=4, alpha=8.0, seed=1)
    seqs = random_sequences(backend.decoder_config.vocab_size, [9, 5], 3)
    datums = make_datums("cross_entropy", seqs, our_logprobs(backend, "a", seqs), 4)
    try:
        assert native._set_fused_cpu_ops(False) is False
        loss_off, ops_off = _profiled_step(backend, datums)
        assert native._set_fused_cpu_ops(True) is True
        loss_on, ops_on = _profiled_step(backend, datums)
    finally:
        native._set_fused_cpu_ops(True)
    assert "aten::silu" in ops_off and not any("SwigluFunction" in op for op in ops_off), sorted(ops_off)
    assert any("SwigluFunction" in op for op in ops_on) and "aten::silu" not in ops_on, sorted(ops_on)
    assert loss_on == pytest.approx(loss_off, rel=1e-5)
