"""Data parallelism on GPUs through a real server (GPU only): `--backend-config` puts two data-parallel ranks on
cuda:0 and cuda:1, which join an NCCL group (Gloo beside it for host tensors), and the server trains a LoRA tenant and
a ZeRO-sharded full fine-tune and samples as a one-process GPU server does. With one GPU visible the server runs
world size 1 (no group) and must still train."""

from __future__ import annotations

import math

import pytest
import torch
from live_server import live_server
from parallel_runs import train_and_sample

pytestmark = pytest.mark.gpu

RANKS = min(2, torch.cuda.device_count())  # NCCL refuses two ranks on one device
TENANTS = (("a", 4, 1), ("full", 0, 3))  # LoRA (all-reduced gradients) and full (reduce-scatter + all-gather)


def test_data_parallel_gpu_server_trains_on_nccl(preset_cache) -> None:
    with live_server(backend_config={"device": "cuda", "fully_sharded_data_parallel_size": RANKS}) as url:
        if RANKS > 1:
            log = url.log_tail(400)
            assert "parallel: 2 ranks (2 data-parallel x 1 tensor-parallel)" in log, log
            assert "collectives on cpu:gloo,cuda:nccl" in log, log
        got = train_and_sample(url, tenants=TENANTS)
    for name, losses in got["losses"].items():
        assert all(math.isfinite(x) for x in losses), (name, losses)
        assert losses[2] < losses[0], (name, losses)  # steps 0 and 2 train on the same batch
    if RANKS == 1:
        return
    with live_server(backend_config={"device": "cuda"}) as url:
        one_process = train_and_sample(url, tenants=TENANTS)
    for name, losses in got["losses"].items():
        # Summed over ranks in another order than one process sums: close, not bitwise.
        assert losses == pytest.approx(one_process["losses"][name], rel=1e-3), name
        assert got["tokens"][name] == one_process["tokens"][name], name
