"""run_ranks: a benchmark's ranks as fresh spawned processes (one per rank, joining a group at a free coordinator
port) and their results by rank; a rank's failure becomes one error carrying its traceback."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any


def _rank_main(fn: Callable[[dict[str, Any], int], Any], job: dict[str, Any], rank: int, out: Any) -> None:
    try:
        out.put((rank, True, fn(job, rank)))
    except Exception:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[[dict[str, Any], int], Any], job: dict[str, Any], world: int, timeout_s: float,
              what: str) -> dict[int, Any]:
    """Runs fn(job | {"address": HOST:PORT, "world": world}, rank) in `world` processes; `fn` must be a module-level
    function (spawn pickles it). Raises RuntimeError naming `what` and every failed rank's traceback."""
    from skyrl_tx.ports import free_local_port

    job = {**job, "world": world, "address": f"127.0.0.1:{free_local_port()}"}
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=_rank_main, args=(fn, job, r, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        reports = [out.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    failed = {rank: value for rank, ok, value in reports if not ok}
    if failed:
        raise RuntimeError(f"{what}: " + "; ".join(f"rank {r}:\n{v}" for r, v in sorted(failed.items())))
    return {rank: value for rank, ok, value in reports}
