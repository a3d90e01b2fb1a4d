"""rebuild_models: after an engine restart, re-creates every live model from its newest recovery snapshot and the
completed requests after it.

The futures table is a write-ahead log of each model's state changes: create (or create-from-checkpoint),
forward_backward (gradients), optim_step, load_weights and ephemeral sampler snapshots. Re-running a model's
completed requests in seq_id order on a fresh backend rebuilds its exact state (per-model computation is
independent of what else shared a batch), so a request interrupted mid-run can simply run again: none of its
effects survived the crash, and none of the completed ones are lost. A model with a usable recovery snapshot
(engine/recovery_state.py, taken right after an optim_step, so no gradients were pending) starts from it and
replays only the requests after it: the cost is bounded by the snapshot interval, not the model's history.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select

from skyrl_tx.db.models import FutureRecord, FutureStatus, ModelRecord, ModelStatus
from skyrl_tx.engine import executor, recovery_state, snapshots

log = logging.getLogger("skyrl_tx.engine")

STATEFUL = ("forward_backward", "optim_step", "load_weights", "save_weights_for_sampler")


def rebuild_models(loop: Any) -> list[str]:
    """Rebuilds every READY model on loop.backend; a model that cannot be rebuilt is marked failed.
    Returns the rebuilt model ids."""
    with loop.sessions() as db:
        models = list(db.scalars(select(ModelRecord).where(ModelRecord.status == ModelStatus.READY.value)
                                 .order_by(ModelRecord.created_at)))
        db.expunge_all()
    rebuilt = []
    for model in models:
        try:
            steps = _replay(loop, model.id)
        except Exception:  # noqa: BLE001 - one broken history must not keep the others from coming back
            log.exception("model %s could not be rebuilt from its request log; marking it failed", model.id)
            with loop.sessions.begin() as db:
                db.get(ModelRecord, model.id).status = ModelStatus.FAILED.value
            continue
        rebuilt.append(model.id)
        log.info("model %s rebuilt from its request log (%d requests replayed)", model.id, steps)
    return rebuilt


def _replay(loop: Any, model_id: str) -> int:
    """Rebuilds one model; returns how many requests it replayed."""
    with loop.sessions() as db:
        create = db.get(FutureRecord, f"{model_id}:create")
        base = recovery_state.recovery_base(db, model_id)
        kept = set(snapshots.ephemeral_newest_first(db, model_id)[:snapshots.KEEP_PER_MODEL])
        db.expunge_all()
    if create is None or create.status != FutureStatus.COMPLETED.value:
        raise RuntimeError(f"model {model_id} has no completed create request")
    if base is None:
        loop.create_in_backend(create.request)
    else:  # the snapshot holds everything up to base.seq_id, a create-from-checkpoint's load included
        loop.create_in_backend({**create.request, "load": None})
        recovery_state.load(loop.backend, loop.checkpointer.store, base, model_id)
        log.info("model %s: restored its recovery snapshot after seq_id %d", model_id, base.seq_id)
    replayed = 0
    # The rows stay attached while they run, so a column loaded on access (a binary body) can still be read.
    with loop.sessions() as db:
        for f in db.scalars(select(FutureRecord).where(
                FutureRecord.model_id == model_id, FutureRecord.status == FutureStatus.COMPLETED.value,
                FutureRecord.request_type.in_(STATEFUL),
                FutureRecord.seq_id > (base.seq_id if base is not None else -1)).order_by(FutureRecord.seq_id)).all():
            _apply(loop, model_id, f, kept)
            replayed += 1
    return replayed


def _apply(loop: Any, model_id: str, f: FutureRecord, kept: set[str]) -> None:
    request = f.request
    if f.request_type == "forward_backward":
        loop.backend.forward_backward(executor.train_requests(loop.database, [f]))
    elif f.request_type == "optim_step":
        loop.backend.optim_step(model_id, executor.optim_params(request))
    elif f.request_type == "load_weights":
        loop.checkpointer.load_into(model_id, request["path"], bool(request["optimizer"]), fresh=True)
    elif request.get("sampling_session_id") in kept:  # an ephemeral sampler, frozen at this point
        loop.checkpointer.snapshot(model_id, request["sampling_session_id"])  # within the snapshot memory budget
