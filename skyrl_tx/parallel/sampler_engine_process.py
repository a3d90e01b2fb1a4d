"""sampler_engine_main: the body of one sampler engine process (parallel/sampler_engines.py starts them).

It loads the base model, joins the trainer's sync group, then serves the trainer's commands from its pipe, between
decode steps of its own continuous batch:
  ("submit", id, SampleRequest)       → later ("done", id, SampleResult) or ("failed", id, error)
  ("sync", snapshot_id, lora, resync) → joins the trainer's WeightSync broadcast, keeps the weights as a frozen
                                        version (LoRA factors when `lora` gives their shape, else full weights), then
                                        ("synced", snapshot_id, error, digest); a resync of a version it holds is
                                        received and dropped (a replaced engine's siblings take part in its catch-up)
  ("regroup", address)                → joins a new sync group (a sibling was replaced), then ("regrouped",)
  ("remove", snapshot_id), ("watch", id) (report its tokens every step: streaming), ("stop",)
While decoding with nothing to report it sends ("alive",) every HEARTBEAT_S, so the trainer can tell it from a hung
one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from skyrl_tx.config import BackendSettings

HEARTBEAT_S = 1.0  # a sampler engine decoding with nothing to report says it is alive this often


def sampler_engine_main(model_dir: str, settings: dict[str, Any], rank: int, world: int, address: str,
                        conn: Any, sync_on_cuda: bool = False) -> None:
    """A sampler engine: loads the base model, joins the sync group (its ranks rank, rank + 1, ... of `world`: one
    per tensor-parallel rank; NCCL on their own devices when sync_on_cuda, else Gloo), then serves commands until
    told to stop."""
    from skyrl_tx.parallel.child_start import start_child_process

    start_child_process(f"sampler engine rank {rank}", settings)  # first: before torch loads (dies with the engine)
    from skyrl_tx.backend.model_backend import make_model_backend
    from skyrl_tx.parallel.weight_sync import JOIN_TIMEOUT_S

    # One process, or (tensor_parallel_size > 1) this process and its own worker ranks, each holding part of the
    # model: every state change and decode step below then runs on all of them (parallel/data_parallel_backend.py),
    # and each of them is a rank of the sync group, receiving every broadcast itself.
    backend = make_model_backend(Path(model_dir), BackendSettings.from_dict(settings))
    digests = backend.settings.weight_sync_digests
    backend.join_weight_sync(address, rank, world, JOIN_TIMEOUT_S, sync_on_cuda)
    running: dict[int, int] = {}  # local sample id → the trainer's id
    watched: set[int] = set()  # the trainer's ids whose progress it asked for (streaming)
    conn.send(("ready", os.getpid()))
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
                _, snapshot_id, lora, resync = message
                # (a resync of a version this engine holds: a sibling's catch-up, received and dropped)
                error, digest = backend.receive_weights(snapshot_id, lora, resync, digests)
                conn.send(("synced", snapshot_id, error, digest))
            elif kind == "regroup":  # a member is gone: every rank leaves the old group and joins the new one
                backend.join_weight_sync(message[1], rank, world, JOIN_TIMEOUT_S, sync_on_cuda)
                conn.send(("regrouped",))
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
