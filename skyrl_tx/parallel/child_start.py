"""start_child_process: what every compute process an engine (or `skyrl-tx worker`) spawns does first."""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from typing import Any

from skyrl_tx.engine.threads import ThreadChoice, configure_threads


def start_child_process(role: str, settings: dict[str, Any]) -> ThreadChoice:
    """Dies with its parent (even a kill -9 of it: the supervisor then restarts the whole group), logs to the
    server's log tagged with `role` (a spawned process starts with no logging set up, so its INFO lines, the thread
    choice among them, were lost), and sizes its thread pools to its share of the node's cores: before this, each
    child kept its parent's count, so N of them ran N x (cores - 1) threads. First thing, before torch loads."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[{role}]: %(message)s")
    return configure_threads(settings.get("device", "cpu"), int(settings.get("num_threads", 0)))
