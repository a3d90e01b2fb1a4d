"""The engine process's own child processes (data-parallel worker ranks, sampler engines) as a test finds them in
/proc, a process's state, for tests that kill one, and a check that a stopped server's processes all exit."""

from __future__ import annotations

import os
import time


def spawned_children(pid: int) -> list[int]:
    """Children of `pid` started by multiprocessing spawn (its ranks or sampler engines; not its resource tracker)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        return []
    spawned = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    spawned.append(child)
        except OSError:
            pass
    return spawned


def process_state(pid: int) -> str:
    """/proc state letter (R, S, Z, ...); X when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (the children of each of its threads, recursively)."""
    tree, queue = [], [pid]
    while queue:
        current = queue.pop()
        tree.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    queue += [int(p) for p in f.read().split()]
        except OSError:  # gone meanwhile
            pass
    return tree


def assert_all_exit(pids: list[int], timeout_s: float = 30.0) -> None:
    """Every process of `pids` exits (or is a zombie) within timeout_s: none outlives its server."""
    deadline = time.monotonic() + timeout_s
    while alive := [p for p in pids if process_state(p) not in ("X", "Z")]:
        assert time.monotonic() < deadline, f"processes outlived their server: {alive}"
        time.sleep(0.2)
