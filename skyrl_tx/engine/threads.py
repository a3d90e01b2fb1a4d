"""Thread-pool policy: how many intra-op / inter-op threads a compute process (engine, rank, bench) runs, and how
its OpenMP threads wait.

Why: an intra-op pool wider than the cores the process really has (the API, other ranks and the user's jobs
share them) makes every parallel region wait for a descheduled thread; measured on a 2-core machine with one
busy process beside the server, torch's default (every core) gave a 30x p90 tail on a training step.

Order of precedence: an explicit OMP_NUM_THREADS in the environment, then the `num_threads` backend-config key,
then the default: on a CPU device the cores of the affinity mask less the ones kept for the API process, split
between the local ranks (at least 1 each); on a GPU a small fixed number (the host side only feeds the device).
Waiting threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE: GNU libgomp, which the torch wheels ship,
honours it as a spin count of 0; KMP_BLOCKTIME=0 does the same for Intel/LLVM OpenMP) unless the environment
already says how to wait (OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME). OpenMP reads those when its library
loads, so they are set before torch is imported; the counts are also applied through torch afterwards.
SKYRL_TX_THREADS=torch leaves everything to torch's defaults (the old behaviour, for benchmarks).

Every compute process applies this policy itself, first thing (the engine; its data-parallel ranks and sampler
engines, parallel/child_start.py; `skyrl-tx worker`'s ranks): the process that plans a node's processes (the
engine, `skyrl-tx worker`) records how many there are in SKYRL_TX_NODE_COMPUTE_PROCESSES, which each of them
inherits, so N processes take one share each instead of N x (cores - 1) threads between them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

log = logging.getLogger("skyrl_tx.engine")

API_CORES = 1  # cores left to the API process on the same host (it parses, stores and answers requests)
GPU_THREADS = 4  # CPU threads of a process whose compute runs on a GPU (kernel launches, host-side ops)
INTEROP_THREADS = 1  # nothing in the engine runs independent torch ops concurrently (no at::launch / jit.fork)
POLICY_ENV = "SKYRL_TX_THREADS"  # "torch": keep torch's defaults (benchmark baseline)
# The count this policy put into OMP_NUM_THREADS: a rank or sampler engine started by an engine inherits it, and
# must not take it for a user's explicit setting (it chooses its own share, given local_ranks).
CHOSEN_ENV = "SKYRL_TX_CHOSEN_NUM_THREADS"
WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# How many compute processes share this node's cores (the local_ranks of every one of them): set by the process that
# starts them, inherited by each.
NODE_PROCESSES_ENV = "SKYRL_TX_NODE_COMPUTE_PROCESSES"


@dataclasses.dataclass(frozen=True)
class ThreadChoice:
    intra_op: int | None  # None: torch's default (SKYRL_TX_THREADS=torch)
    inter_op: int | None
    source: str  # OMP_NUM_THREADS | num_threads | default | torch
    reason: str  # for the startup log: what the count was derived from
    env: dict[str, str]  # variables to set before torch (and its OpenMP) loads
    waits: dict[str, str] = dataclasses.field(default_factory=dict)  # how OpenMP threads wait (set or inherited)

    def describe(self) -> str:
        if self.intra_op is None:
            return f"threads: torch defaults ({self.reason})"
        waits = ", ".join(f"{k}={v}" for k, v in self.waits.items()) or "OpenMP's default"
        return (f"threads: intra-op {self.intra_op}, inter-op {self.inter_op} ({self.source}: {self.reason}); "
                f"waiting threads: {waits}")


def affinity_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's cpuset shows here too)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else 0
    except ValueError:
        return None
    return value if value > 0 else None


def wait_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Sleep-don't-spin settings, unless the environment already chose how OpenMP threads wait."""
    if any(k in environ for k in WAIT_ENV):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def choose_threads(device: str = "cpu", num_threads: int = 0, *, cores: int | None = None,
                   environ: Mapping[str, str] | None = None, local_ranks: int | None = None,
                   reserved_cores: int = API_CORES) -> ThreadChoice:
    """The thread counts for one compute process on `device` (see the module docstring for the order), one of
    `local_ranks` compute processes on this node (None: the count its parent recorded, else 1)."""
    environ = os.environ if environ is None else environ
    if environ.get(POLICY_ENV, "").strip().lower() == "torch":
        return ThreadChoice(None, None, "torch", f"{POLICY_ENV}=torch", {})
    if local_ranks is None:
        local_ranks = _positive_int(environ.get(NODE_PROCESSES_ENV)) or 1
    cores = affinity_cores() if cores is None else cores
    inherited = environ.get(CHOSEN_ENV)
    explicit = _positive_int(environ.get("OMP_NUM_THREADS"))
    if inherited is not None and environ.get("OMP_NUM_THREADS") == inherited:
        explicit = None  # our own parent's choice, not the user's
    if explicit is not None:
        intra, source, reason = explicit, "OMP_NUM_THREADS", "set in the environment"
    elif num_threads > 0:
        intra, source, reason = num_threads, "num_threads", "backend config"
    else:
        share = max(1, (cores - reserved_cores) // max(1, local_ranks))
        per_rank = f", split between {local_ranks} compute processes on this node" if local_ranks > 1 else ""
        if device == "cpu":
            intra = share
            reason = f"{cores} cores in the affinity mask, {reserved_cores} kept for the API{per_rank}"
        else:
            intra = min(GPU_THREADS, share)
            reason = f"device {device}: at most {GPU_THREADS} host threads ({cores} cores in the affinity mask)"
        source = "default"
    env = {"OMP_NUM_THREADS": str(intra), NODE_PROCESSES_ENV: str(local_ranks), **wait_env(environ)}
    if source != "OMP_NUM_THREADS":  # the user's own setting stays explicit for every process started later
        env[CHOSEN_ENV] = str(intra)
    if "MKL_NUM_THREADS" not in environ or environ.get("MKL_NUM_THREADS") == inherited:
        env["MKL_NUM_THREADS"] = str(intra)
    waits = {k: env.get(k, environ.get(k)) for k in WAIT_ENV if k in env or k in environ}
    return ThreadChoice(intra, INTEROP_THREADS, source, reason, env, waits)


_applied: ThreadChoice | None = None


def configure_threads(device: str = "cpu", num_threads: int = 0, *, local_ranks: int | None = None,
                      environ: MutableMapping[str, str] | None = None) -> ThreadChoice:
    """Chooses and applies the thread counts of this process (once: later calls return the first choice), and
    logs them with its pid. Call it before torch is imported so the wait policy reaches OpenMP; later, only the
    counts do. local_ranks: see choose_threads; what it comes to is exported for the processes started later."""
    global _applied
    if _applied is not None:
        return _applied
    environ = os.environ if environ is None else environ
    choice = choose_threads(device, num_threads, environ=environ, local_ranks=local_ranks)
    torch_was_loaded = "torch" in sys.modules
    environ.update(choice.env)
    import torch

    if choice.intra_op is not None:
        torch.set_num_threads(choice.intra_op)
        try:
            torch.set_num_interop_threads(choice.inter_op)
        except RuntimeError:  # the inter-op pool already started (torch was in use before the engine)
            pass
    late = "; torch was loaded before this call, so the wait policy did not reach OpenMP" \
        if torch_was_loaded and choice.env else ""
    log.info("%s -> torch runs %d intra-op / %d inter-op threads (pid %d)%s", choice.describe(),
             torch.get_num_threads(), torch.get_num_interop_threads(), os.getpid(), late)
    _applied = choice
    return choice


def share_node_cores(processes: int, environ: MutableMapping[str, str] | None = None) -> None:
    """Records that `processes` compute processes share this node's cores, for the processes started afterwards (a
    node process that itself computes nothing: `skyrl-tx worker`)."""
    (os.environ if environ is None else environ)[NODE_PROCESSES_ENV] = str(max(1, processes))
