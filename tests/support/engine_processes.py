"""The engine process's own child processes (data-parallel worker ranks, sampler engines) as a test finds them in
/proc, and a process's state, for tests that kill one."""

from __future__ import annotations


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
