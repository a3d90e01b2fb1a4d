"""collect_rank_reports: waits for spawned ranks' (rank, result) reports, and on a timeout says what did arrive and
which processes still run (a rank's traceback usually explains why the others wait)."""

from __future__ import annotations

import queue
import time
from typing import Any


def collect_rank_reports(procs: list[Any], out: Any, expected: int, timeout_s: float, what: str) -> dict[int, Any]:
    """`expected` reports from `out` within `timeout_s`; then joins the processes. Kills them all on a timeout."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < expected:
        try:
            rank, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            states = {i: ("running" if p.is_alive() else f"exit code {p.exitcode}") for i, p in enumerate(procs)}
            for p in procs:
                p.kill()
            raise AssertionError(f"{what}: {len(results)} of {expected} ranks reported within {timeout_s:g} s; "
                                 f"reported: {results}; processes: {states}") from None
        results[rank] = value
    for p in procs:
        p.join(timeout_s)
    return results


def spawn_ranks(target: Any, world: int, args_of: Any, timeout_s: float, what: str) -> dict[int, Any]:
    """Runs target(*args_of(rank, port, out)) in `world` fresh spawned processes (`port`: a free coordinator port,
    `out`: the queue each puts its (rank, result) on) and returns their reports by rank."""
    import multiprocessing

    from live_server import free_port

    context = multiprocessing.get_context("spawn")
    out, port = context.Queue(), free_port()
    procs = [context.Process(target=target, args=args_of(rank, port, out), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    return collect_rank_reports(procs, out, world, timeout_s, what)
