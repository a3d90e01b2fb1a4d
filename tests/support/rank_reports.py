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


# What the fork server imports once, before it forks any rank: torch (~2 CPU-s per fresh interpreter), the core, and
# the helpers the ranks' targets import. A module missing here is imported by each rank, as under spawn.
RANK_PRELOAD = ["torch", "numpy", "skyrl_tx.backend.native", "skyrl_tx.parallel.group", "train_reference",
                "split_parity"]


def rank_context() -> Any:
    """The multiprocessing context the tests start ranks in: a fork server (one per test process, started on first
    use) that has imported RANK_PRELOAD, so a rank starts in a fraction of a CPU-second where a spawned one imported
    torch again (~2.6 CPU-s of a tensor-parallel test's 3.6 per rank on CI's 2 cores). Each rank is a fork of the
    server, which has only imported modules (no computation, no thread pool started), not of the test process."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts, on first use
    return context


def _with_parent_output(parent: int, target: Any, *args: Any) -> None:
    """Runs target(*args) writing to the starting process's current stdout/stderr: a forked rank inherits the fork
    server's, which are those of the test that started it (pytest captures each test's output), so a rank's crash
    report would land in another test's capture."""
    import os

    for fd in (1, 2):
        try:
            opened = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # not Linux, or the parent is gone: the fork server's output
            continue
        os.dup2(opened, fd)
        os.close(opened)
    target(*args)


def rank_process(context: Any, target: Any, args: tuple, **kwargs: Any) -> Any:
    """context.Process running target(*args) in a rank of `context` (rank_context()), writing to the caller's output."""
    import os

    return context.Process(target=_with_parent_output, args=(os.getpid(), target, *args), daemon=True, **kwargs)


def spawn_ranks(target: Any, world: int, args_of: Any, timeout_s: float, what: str) -> dict[int, Any]:
    """Runs target(*args_of(rank, port, out)) in `world` fresh processes (rank_context(); `port`: a free coordinator
    port, `out`: the queue each puts its (rank, result) on) and returns their reports by rank."""
    from live_server import free_port

    context = rank_context()
    out, port = context.Queue(), free_port()
    procs = [rank_process(context, target, args_of(rank, port, out)) for rank in range(world)]
    for p in procs:
        p.start()
    return collect_rank_reports(procs, out, world, timeout_s, what)
