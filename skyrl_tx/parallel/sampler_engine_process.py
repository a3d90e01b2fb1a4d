"""sampler_engine_main: the body of one sampler engine process (parallel/sampler_engine_pool.py starts them).

It loads the base model, says ("loaded", pid), then serves the trainer's commands from its pipe, between decode steps
of its own continuous batch:
  ("regroup", tag, address, rank, world, timeout_s) → every rank of it leaves its sync group (if any) and joins the
                                        trainer's new one at `address` (its first rank `rank` of `world`), then
                                        ("regrouped", tag, error): error None, or why the join failed (it then waits
                                        for the next regroup). The first one comes once it said "loaded".
  ("submit", id, SampleRequest)       → later ("done", id, SampleResult) or ("failed", id, error)
  ("sync", tag, snapshot_id, lora, resync) → joins the trainer's WeightSync broadcast, keeps the weights as a frozen
                                        version (LoRA factors when `lora` gives their shape, else full weights), then
                                        ("synced", tag, snapshot_id, error, digest); a resync of a version it holds is
                                        received and dropped (a replaced engine's siblings take part in its catch-up);
                                        a broadcast that breaks (another member died) is the error, and the engine
                                        goes on serving until the trainer regroups it
  ("remove", snapshot_id), ("watch", id) (report its tokens every step: streaming), ("stop",)
While decoding with nothing to report it sends ("alive",) every HEARTBEAT_S, so the trainer can tell it from a hung
one.

Test hooks (tests/parallel/test_sampler_engine_replacement.py), read from the environment, so a test controls when an
engine starts or dies by construction rather than timing: with SKYRL_TX_TEST_SAMPLER_START_GATE=<path>, a
*replacement* engine (not one of the first ones) waits, before it loads the model, until <path> exists (or it is told
to stop); with SKYRL_TX_TEST_SAMPLER_SYNC_EXIT=<prefix>, engine i exits, the moment a sync command reaches it (the
trainer is then inside the broadcast), if the file <prefix><i> exists (it deletes the file first: one exit per file);
with SKYRL_TX_TEST_SAMPLER_JOIN_FAIL=<path>, a replacement answers every regroup with an error while <path> exists.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from skyrl_tx.config import BackendSettings

HEARTBEAT_S = 1.0  # a sampler engine decoding with nothing to report says it is alive this often


START_GATE_ENV = "SKYRL_TX_TEST_SAMPLER_START_GATE"  # the test hooks of the module docstring
SYNC_EXIT_ENV = "SKYRL_TX_TEST_SAMPLER_SYNC_EXIT"
JOIN_FAIL_ENV = "SKYRL_TX_TEST_SAMPLER_JOIN_FAIL"


def sampler_engine_main(model_dir: str, settings: dict[str, Any], index: int, conn: Any, sync_on_cuda: bool = False,
                        replacement: bool = False) -> None:
    """Sampler engine `index`: loads the base model, then serves commands until told to stop (the first ones
    regroup it into the trainer's sync group: one rank per tensor-parallel rank; NCCL on their own devices when
    sync_on_cuda, else Gloo)."""
    from skyrl_tx.parallel.child_start import start_child_process

    start_child_process(f"sampler engine {index}", settings)  # first: before torch loads (dies with the engine)
    gate = os.environ.get(START_GATE_ENV)
    if replacement and gate:
        while not os.path.exists(gate):  # the test hook: held until the test creates the file
            if conn.poll(0.05) and conn.recv()[0] == "stop":
                return
    from skyrl_tx.backend.model_backend import make_model_backend
    from skyrl_tx.errors import InternalError

    # One process, or (tensor_parallel_size > 1) this process and its own worker ranks, each holding part of the
    # model: every state change and decode step below then runs on all of them (parallel/data_parallel_backend.py),
    # and each of them is a rank of the sync group, receiving every broadcast itself.
    backend = make_model_backend(Path(model_dir), BackendSettings.from_dict(settings))
    digests = backend.settings.weight_sync_digests
    conn.send(("loaded", os.getpid()))
    running: dict[int, int] = {}  # local sample id → the trainer's id
    watched: set[int] = set()  # the trainer's ids whose progress it asked for (streaming)
    last_sent = time.monotonic()
    while True:
        if conn.poll(0 if running else None):
            message = conn.recv()
            kind = message[0]
            if kind == "stop":
                backend.close()
                return
            if kind == "submit":
                _, sample_id, request = message
                try:
                    running[backend.submit_sample(request)] = sample_id
                    if request.stream:  # reported from its first step, before the trainer could ask
                        watched.add(sample_id)
                except Exception as exc:  # noqa: BLE001 - the request's error, reported to the trainer
                    conn.send(("failed", sample_id, exc))
            elif kind == "sync":  # the trainer broadcasts right after sending this: join it at once
                _, tag, snapshot_id, lora, resync = message
                _exit_if_asked(index)
                # (a resync of a version this engine holds: a sibling's catch-up, received and dropped)
                try:
                    error, digest = backend.receive_weights(snapshot_id, lora, resync, digests)
                except Exception as exc:  # noqa: BLE001 - the group broke (a member died): the trainer regroups
                    error, digest = InternalError(f"the weight sync of {snapshot_id!r} broke: {exc}"), None
                conn.send(("synced", tag, snapshot_id, error, digest))
            elif kind == "regroup":  # a member came or went: every rank leaves the old group and joins the new one
                _, tag, address, rank, world, timeout_s = message
                try:
                    if replacement and os.path.exists(os.environ.get(JOIN_FAIL_ENV) or "\0"):  # the test hook
                        raise RuntimeError("the test hook refuses this replacement's join")
                    backend.join_weight_sync(address, rank, world, timeout_s, sync_on_cuda)
                    conn.send(("regrouped", tag, None))
                except Exception as exc:  # noqa: BLE001 - reported; the trainer regroups again or replaces it
                    conn.send(("regrouped", tag, str(exc)))
            elif kind == "remove":
                if backend.has_snapshot(message[1]):
                    backend.remove_snapshot(message[1])
            elif kind == "watch":
                watched.add(message[1])
            continue  # every queued command before the next decode step
        finished = backend.sample_step()
        for local_id, result in finished:
            sample_id = running.pop(local_id)
            watched.discard(sample_id)
            conn.send(("done", sample_id, result))
        mine = {local: remote for local, remote in running.items() if remote in watched}
        if mine:
            progress = backend.sample_progress(list(mine))
            conn.send(("progress", {mine[local]: tokens for local, tokens in progress.items()}))
        if finished or mine:
            last_sent = time.monotonic()
        elif running and time.monotonic() - last_sent >= HEARTBEAT_S:  # decoding, nothing to report: alive
            conn.send(("alive",))
            last_sent = time.monotonic()


def _exit_if_asked(index: int) -> None:
    """The SYNC_EXIT_ENV test hook (module docstring): this engine dies inside a sync, by construction."""
    prefix = os.environ.get(SYNC_EXIT_ENV)
    if prefix and os.path.exists(f"{prefix}{index}"):
        os.remove(f"{prefix}{index}")
        os._exit(1)
