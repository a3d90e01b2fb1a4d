"""The NCCL path of the parallel code (GPU only): every collective the core issues, on a one-rank NCCL group of CUDA
tensors, gives what one process computes; a data-parallel and a tensor-parallel backend on that group train and
sample as a plain GPU backend. (Several GPUs: tests/parallel's checks with device cuda are the next step.)"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from live_server import free_port

pytestmark = pytest.mark.gpu


def _group_of_one(device: str):
    from skyrl_tx.parallel.group import RankAddress, join_group

    return join_group(RankAddress(f"127.0.0.1:{free_port()}", 0, 1), device=device, timeout_s=60)


def _check_collectives_and_backends(model_dir: str, out, device: str = "cuda") -> None:
    try:
        from train_reference import ROBUST_ADAM, make_datums, our_logprobs, random_sequences

        from skyrl_tx.backend.native import NativeBackend
        from skyrl_tx.config import BackendSettings
        from skyrl_tx.types import SampleRequest, SamplingParams, TrainRequest

        group = _group_of_one(device)  # NCCL on CUDA (Gloo on a CPU: how this check is itself checked)
        x = torch.arange(12, dtype=torch.float32, device=device)
        y = x.clone()
        group.all_reduce_sum(y)
        assert torch.equal(y, x)
        assert torch.equal(group.reduce_scatter_sum(x), x) and torch.equal(group.all_gather(x), x)
        group.broadcast(y, 0)
        assert set(group.stats()) >= {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
        settings = BackendSettings(device=device, max_lora_adapters=2, max_lora_rank=4, max_sampling_sequences=4,
                                   max_sampling_length=64)
        results = []
        for layout in ("plain", "data-parallel", "tensor-parallel"):
            backend = NativeBackend(model_dir, settings, tensor_parallel=group if layout == "tensor-parallel"
                                    else None)
            if layout == "data-parallel":
                backend.attach_collectives(group)
            backend.create_model("a", lora_rank=4, alpha=8.0, seed=1)
            vocab = backend.decoder_config.vocab_size
            seqs = random_sequences(vocab, [9, 5, 7], 3)
            datums = make_datums("cross_entropy", seqs, our_logprobs(backend, "a", seqs), 4)
            losses = []
            for _ in range(3):
                losses.append(backend.forward_backward([TrainRequest("a", datums, "cross_entropy")])[0]
                              .metrics["loss:sum"])
                backend.optim_step("a", ROBUST_ADAM)
            sample = backend.sample([SampleRequest(seqs[0], SamplingParams(max_tokens=8, temperature=0.0, stop=[]),
                                                   weights_id="a")])[0]
            results.append((losses, sample.sequences[0].tokens))
        for losses, tokens in results[1:]:
            assert losses == pytest.approx(results[0][0], rel=1e-5) and tokens == results[0][1], results
        out.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        import traceback

        out.put(f"{exc!r}\n{traceback.format_exc()}")


def test_nccl_group_of_one_matches_one_process(tiny_model_dir) -> None:
    """In a process of its own: torch.distributed allows one default group per process."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    proc = context.Process(target=_check_collectives_and_backends, args=(str(tiny_model_dir("tiny-qwen3")), out))
    proc.start()
    result = out.get(timeout=300)
    proc.join(60)
    assert result == "ok", result
