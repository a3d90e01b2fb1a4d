"""The trainer → sampler-engine weight sync on NCCL (GPU only): join_side_group on a CUDA device makes an NCCL group,
and WeightSync moves CUDA tensors bit for bit. One GPU: a one-rank group (the NCCL backend, the CUDA manifest and
buckets, sources on other devices). Two or more: the trainer on cuda:0 and a receiver on cuda:1, digests equal."""

from __future__ import annotations

import multiprocessing
import traceback
from typing import Any

import pytest
import torch
from live_server import free_port
from rank_reports import collect_rank_reports

pytestmark = pytest.mark.gpu


def _tensors(device: str) -> dict[str, Any]:
    """Bucketing's cases on a GPU: dtypes that cannot share a bucket, one larger than a bucket (sent in place), an
    empty and a 0-d tensor, a non-contiguous view, and a CPU tensor the root copies into a CUDA bucket."""
    g = torch.Generator().manual_seed(3)
    return {"a.fp32": torch.randn(10, 7, generator=g).to(device),
            "b.bf16": torch.randn(300, generator=g).to(torch.bfloat16).to(device),
            "c.big": torch.randn(1000, generator=g).to(device), "d.empty": torch.empty(0, 4, device=device),
            "e.scalar": torch.tensor(2.0, device=device), "f.transposed": torch.randn(6, 5, generator=g).to(device).t(),
            "g.on_cpu": torch.randn(4, generator=g)}


def _rank_main(rank: int, world: int, port: int, out: Any) -> None:
    try:
        from skyrl_tx.parallel.group import RankAddress, join_side_group
        from skyrl_tx.parallel.weight_sync import make_weight_sync, weights_digest

        device = f"cuda:{rank}"
        group = join_side_group(RankAddress(f"127.0.0.1:{port}", rank, world), device=device, timeout_s=120)
        sync = make_weight_sync(group, root=0, bucket_bytes=1000)
        got = sync.sync(7, _tensors(device) if rank == 0 else {}, device)
        devices = sorted({str(t.device) for name, t in got.items() if name != "g.on_cpu" or rank != 0})
        out.put((rank, {"digest": weights_digest(got), "devices": devices, "version": sync.last.version,
                        "buckets": sync.last.buckets, "broadcasts": group.stats()["broadcast"].calls}))
    except Exception:  # noqa: BLE001 - reported to the test
        out.put((rank, traceback.format_exc()))


def _run(world: int) -> dict[int, Any]:
    context = multiprocessing.get_context("spawn")
    out, port = context.Queue(), free_port()
    procs = [context.Process(target=_rank_main, args=(rank, world, port, out), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    return collect_rank_reports(procs, out, world, 300, "NCCL weight sync")


def test_a_one_rank_nccl_sync_group_returns_the_roots_tensors() -> None:
    from skyrl_tx.parallel.weight_sync import weights_digest

    report = _run(1)[0]
    assert isinstance(report, dict), report
    assert report["digest"] == weights_digest(_tensors("cpu")) and report["devices"] == ["cuda:0"], report
    # fp32 [10, 7] | bf16 | big alone | 0-d + transposed + the CPU one: 4 buckets, after the header and manifest
    assert report["version"] == 7 and report["buckets"] == 4 and report["broadcasts"] == 6, report


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL refuses two ranks on one device)")
def test_a_receiver_on_another_gpu_gets_the_trainers_tensors_bit_for_bit() -> None:
    from skyrl_tx.parallel.weight_sync import weights_digest

    reports = _run(2)
    for rank, report in reports.items():
        assert isinstance(report, dict), f"rank {rank}:\n{report}"
        assert report["digest"] == weights_digest(_tensors("cpu")), rank
        assert report["devices"] == [f"cuda:{rank}"] and report["version"] == 7, report
