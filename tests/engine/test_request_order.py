"""EngineLoop ordering under gaps: a missing seq_id is waited for (never skipped), an edge-rejected one is a stored
failure that fills it, and an unload ends the wait by failing what can never run. Real core, real SQLite."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from engine_rows import DATUM, add, create, future, results

from skyrl_tx.db.models import FutureRecord, ModelRecord
from skyrl_tx.db.unload_requests import request_unloads

MODEL = "s:train:0"
FB = {"model_id": MODEL, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
STEP = {"model_id": MODEL, "adam_params": {"learning_rate": 0.05}}


def _old(record: FutureRecord, seconds: float = 3600) -> FutureRecord:
    record.created_at = datetime.now(timezone.utc) - timedelta(seconds=seconds)
    return record


def test_a_missing_seq_id_is_waited_for_however_long(loop) -> None:
    create(loop, "s", MODEL)
    add(loop, _old(future(f"{MODEL}:2", "optim_step", STEP, MODEL, 2)))  # waited an hour for seq 1
    for _ in range(3):
        loop.step()
    assert results(loop)[f"{MODEL}:2"].status == "pending"
    assert loop.order.waiting_for(MODEL) == 1
    add(loop, future(f"{MODEL}:1", "forward_backward", FB, MODEL, 1))
    for _ in range(3):
        loop.step()
    done = results(loop)
    assert done[f"{MODEL}:1"].status == done[f"{MODEL}:2"].status == "completed"
    assert done[f"{MODEL}:2"].result["metrics"]["grad_norm"] > 0  # the step ran after the gradients
    assert done[f"{MODEL}:1"].completed_at <= done[f"{MODEL}:2"].completed_at
    assert loop.order.waiting_for(MODEL) is None


def test_a_request_rejected_at_the_edge_fills_its_gap(loop) -> None:
    create(loop, "s", MODEL)
    add(loop, future(f"{MODEL}:2", "forward_backward", FB, MODEL, 2))
    loop.step()
    assert results(loop)[f"{MODEL}:2"].status == "pending"
    rejected = future(f"{MODEL}:1", "forward_backward", FB, MODEL, 1)  # as the API stores a 400
    rejected.status, rejected.error = "failed", {"category": "user", "code": "invalid_argument", "message": "bad"}
    rejected.completed_at = datetime.now(timezone.utc)
    add(loop, rejected)
    loop.step()
    assert results(loop)[f"{MODEL}:2"].status == "completed"


def test_an_unload_fails_what_waits_behind_a_gap_and_frees_the_slot(loop) -> None:
    create(loop, "s", MODEL)
    add(loop, future(f"{MODEL}:1", "forward_backward", FB, MODEL, 1),
        future(f"{MODEL}:3", "optim_step", STEP, MODEL, 3))  # seq 2 never comes: the client went away
    loop.step()
    with loop.sessions.begin() as db:  # the session finishes (POST sessions/{id}/finish does this)
        assert request_unloads(db, "s") == [MODEL]
    loop.step()
    done = results(loop)
    assert done[f"{MODEL}:1"].status == "completed"  # accepted work before the gap ran
    assert done[f"{MODEL}:3"].status == "failed" and "seq_id 2" in done[f"{MODEL}:3"].error["message"]
    assert done[f"{MODEL}:unload"].status == "completed"
    with loop.sessions() as db:
        assert db.get(ModelRecord, MODEL).status == "unloaded"
    loop.backend.create_model("a", lora_rank=4)  # max_lora_adapters=2: both slots are free again
    loop.backend.create_model("b", lora_rank=4)


def test_a_model_unloaded_before_its_create_ran_is_never_created(loop) -> None:
    create(loop, "s", MODEL)
    add(loop, ModelRecord(id="s:train:1", session_id="s", base_model="tiny-qwen3", lora_rank=4),
        future("s:train:1:create", "create_model", {"model_id": "s:train:1", "lora_rank": 4, "seed": 1,
                                                     "train_attn": True, "train_mlp": True, "train_unembed": True}))
    with loop.sessions.begin() as db:
        assert sorted(request_unloads(db, "s")) == [MODEL, "s:train:1"]
    loop.step()
    done = results(loop)
    assert done["s:train:1:create"].status == "failed"
    loop.backend.create_model("a", lora_rank=4)
    loop.backend.create_model("b", lora_rank=4)
