"""timed: wall-clock seconds of repeated calls, after untimed warm-up calls (shared by the benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out
