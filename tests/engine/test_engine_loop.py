"""EngineLoop on the real core and a real SQLite database: batching across models, ordering, expiry, recovery."""

from __future__ import annotations

import logging
import os
from datetime import datetime, timedelta, timezone

import pytest
import torch
from sqlalchemy import select

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.db.models import CheckpointRecord, ModelRecord, SessionRecord
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.checkpoints.store import PARTIAL_MARKER
from skyrl_tx.db.future_queries import RESULT_IN_DATABASE
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.loop import MAX_ATTEMPTS, EngineLoop
from skyrl_tx.engine.process import done_line, parse_done_line
from skyrl_tx.engine.snapshots import KEEP_PER_MODEL

from engine_rows import DATUM, add, create, future, results, stored_result


def test_requests_of_two_models_run_in_seq_order_with_barriers(loop: EngineLoop) -> None:
    create(loop, "s", "s:train:0")
    fb = {"model_id": "s:train:0", "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    # Stored out of order: seq 3 (forward_backward after the step) before seq 1 and the step (seq 2).
    add(loop, future("s:train:0:3", "forward_backward", fb, "s:train:0", 3),
        future("s:train:0:2", "optim_step", {"model_id": "s:train:0", "adam_params": {"learning_rate": 0.05}},
               "s:train:0", 2),
        future("s:train:0:1", "forward_backward", fb, "s:train:0", 1))
    for _ in range(4):
        loop.step()
    done = results(loop)
    assert all(done[f"s:train:0:{i}"].status == "completed" for i in (1, 2, 3))
    first, after = stored_result(done["s:train:0:1"]), stored_result(done["s:train:0:3"])
    # seq 3 saw the weights after the optim step of seq 2, so its loss is lower than seq 1's.
    assert after["metrics"]["loss:sum"] < first["metrics"]["loss:sum"]


def test_finished_futures_are_reported_as_stored(loop: EngineLoop) -> None:
    """retrieve_future answers a woken long-poll from the reported outcome instead of reading the row back: the
    report (also after the engine process's line encoding) must equal the row, failures included."""
    reported = []
    loop.notify = reported.extend
    create(loop, "s", "s:train:0")
    fb = {"model_id": "s:train:0", "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    add(loop, future("s:train:0:1", "forward_backward", fb, "s:train:0", 1),
        future("s:train:0:2", "forward_backward", {**fb, "loss_fn": "no_such_loss"}, "s:train:0", 2),
        future("s:train:0:3", "optim_step", {"model_id": "s:train:0", "adam_params": {"learning_rate": 0.05}},
               "s:train:0", 3))
    for _ in range(3):
        loop.step()
    stored = results(loop)
    assert {o.id for o in reported} == {"s:train:0:create", "s:train:0:1", "s:train:0:2", "s:train:0:3"}
    assert [o.status for o in reported if o.id == "s:train:0:2"] == ["failed"]
    for outcome in reported:  # in process: a forward_backward's result is the stored protobuf itself
        row = stored[outcome.id]
        assert (outcome.status, outcome.request_type, outcome.result, outcome.error) == (
            row.status, row.request_type, row.result if row.result_body is None else row.result_body, row.error)
    assert isinstance(stored["s:train:0:1"].result_body, bytes) and stored["s:train:0:1"].result is None
    for outcome in parse_done_line(done_line(reported)):  # between processes: binary results stay in the database
        row = stored[outcome.id]
        assert (outcome.status, outcome.request_type, outcome.result, outcome.error) == (
            row.status, row.request_type, row.result if row.result_body is None else RESULT_IN_DATABASE, row.error)


def test_pending_scan_reads_no_body() -> None:
    # The engine scans every pending request on each step: it must not drag megabytes of tensors along.
    from skyrl_tx.db import future_queries

    scanned = set(future_queries.PENDING.selected_columns.keys())
    assert {"id", "request_type", "model_id", "seq_id", "request"} <= scanned
    assert not scanned & {"request_body", "result", "result_body", "error"}


def test_rows_stored_before_binary_bodies_still_run(loop: EngineLoop) -> None:
    """A forward_backward stored with its datums in the JSON column (before migration 0003) gives the same result
    as the same request stored as a protobuf body."""
    create(loop, "s", "s:train:0")
    fb = {"model_id": "s:train:0", "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM, DATUM]}
    add(loop, future("s:train:0:1", "forward", fb, "s:train:0", 1, legacy_json=True),
        future("s:train:0:2", "forward", fb, "s:train:0", 2))
    loop.step()
    done = results(loop)
    assert done["s:train:0:1"].request_body is None and "data" in done["s:train:0:1"].request
    assert "data" not in done["s:train:0:2"].request
    legacy, binary = stored_result(done["s:train:0:1"]), stored_result(done["s:train:0:2"])
    assert len(binary["loss_fn_outputs"]) == 2 and len(binary["loss_fn_outputs"][0]["logprobs"]) == 4
    assert binary == legacy


def test_bad_request_in_a_batch_fails_alone_with_a_user_error(loop: EngineLoop) -> None:
    create(loop, "s", "s:train:0")
    good = {"model_id": "s:train:0", "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    bad = {**good, "loss_fn_config": {"beta": 1.0}}
    add(loop, future("s:train:0:1", "forward_backward", good, "s:train:0", 1),
        future("s:train:0:2", "forward_backward", bad, "s:train:0", 2))
    loop.step()
    done = results(loop)
    assert done["s:train:0:1"].status == "completed"
    assert done["s:train:0:2"].status == "failed"
    assert done["s:train:0:2"].error["category"] == "user" and "beta" in done["s:train:0:2"].error["message"]


def test_silent_session_loses_its_models_and_frees_the_slot(loop: EngineLoop) -> None:
    stale = datetime.now(timezone.utc) - timedelta(seconds=120)
    create(loop, "old", "old:train:0", heartbeat=stale)
    create(loop, "new", "new:train:0")
    assert loop.expire_sessions() == ["old:train:0"]
    loop.step()  # the unload request the sweep stored
    with loop.sessions() as db:
        assert db.get(ModelRecord, "old:train:0").status == "unloaded"
        assert db.get(SessionRecord, "old").status == "expired"
        assert db.get(ModelRecord, "new:train:0").status == "ready"
    loop.backend.create_model("reuses-the-slot", lora_rank=4)  # max_lora_adapters=2: the old slot is free again


def test_restarted_engine_rebuilds_models_and_reruns_interrupted_requests(loop: EngineLoop, tiny_model_dir) -> None:
    create(loop, "s", "s:train:0")
    fb = {"model_id": "s:train:0", "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    add(loop, future("s:train:0:1", "forward_backward", fb, "s:train:0", 1),
        future("s:train:0:2", "optim_step", {"model_id": "s:train:0", "adam_params": {"learning_rate": 0.05}},
               "s:train:0", 2),
        future("s:train:0:3", "forward_backward", fb, "s:train:0", 3))
    for _ in range(4):
        loop.step()
    state, grads = loop.backend.trainable_state("s:train:0"), loop.backend.trainable_grads("s:train:0")
    interrupted = future("s:train:0:4", "optim_step", {"model_id": "s:train:0", "adam_params": {}}, "s:train:0", 4)
    interrupted.status, interrupted.attempts = "running", 1  # the engine died while running it
    poisonous = future("s:train:0:99", "forward", fb, "s:train:0", 99)
    poisonous.status, poisonous.attempts = "running", MAX_ATTEMPTS  # it was running in every crash so far
    sample = future("smp:0", "sample", {"weights_id": "", "prompt_tokens": [1, 2], "num_samples": 1,
                                        "sampling_params": {"max_tokens": 2, "temperature": 0.0}})
    sample.status = "running"
    add(loop, interrupted, poisonous, sample)

    # A new engine on a fresh backend (what a restarted engine process has) and the same database.
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=2))
    checkpointer = Checkpointer(backend, loop.checkpointer.store, loop.sessions, loop.checkpointer.model_dir)
    restarted = EngineLoop(backend, loop.sessions, checkpointer, session_timeout_s=60)
    restarted.recover()
    for name, tensor in backend.trainable_state("s:train:0").items():
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=1e-6)
    for name, tensor in backend.trainable_grads("s:train:0").items():
        torch.testing.assert_close(tensor, grads[name], atol=1e-6, rtol=1e-6)
    done = results(restarted)
    assert done["s:train:0:4"].status == "pending" and done["smp:0"].status == "pending"
    assert done["s:train:0:99"].status == "failed" and "will not be retried" in done["s:train:0:99"].error["message"]
    for _ in range(5):
        restarted.step()
    done = results(restarted)
    assert done["s:train:0:4"].status == "completed" and done["smp:0"].status == "completed"
    assert done["s:train:0:4"].attempts == 2


def test_save_interrupted_by_an_engine_stop_is_never_listed(loop: EngineLoop) -> None:
    create(loop, "s", "s:train:0")
    store = loop.checkpointer.store
    path = TinkerPath("s:train:0", "weights", "cut_short")
    partial = f"{store.location(path)}{PARTIAL_MARKER}0123"
    os.makedirs(partial)  # what a process killed mid-write leaves behind
    add(loop, CheckpointRecord(model_id="s:train:0", kind="weights", name="cut_short", tinker_path=str(path),
                               storage_uri=store.location(path), status="writing"))
    loop.recover()
    with loop.sessions() as db:
        row = db.scalar(select(CheckpointRecord).where(CheckpointRecord.tinker_path == str(path)))
        assert row.status == "failed"
    assert not os.path.exists(partial)
    # The name is free again: the next save of it succeeds and is listed.
    add(loop, future("s:train:0:1", "save_weights", {"model_id": "s:train:0", "path": str(path)}, "s:train:0", 1))
    loop.step()  # starts the save on the background writer
    loop.checkpointer.saves.wait()
    loop.step()  # stores it
    assert results(loop)["s:train:0:1"].status == "completed"
    with loop.sessions() as db:
        assert db.scalar(select(CheckpointRecord.status).where(CheckpointRecord.tinker_path == str(path))) == "ready"


def test_only_the_newest_sampler_snapshots_of_a_model_stay_in_memory(loop: EngineLoop) -> None:
    create(loop, "s", "s:train:0")
    count = KEEP_PER_MODEL + 2
    for i in range(1, count + 1):
        add(loop, future(f"s:train:0:{i}", "save_weights_for_sampler",
                         {"model_id": "s:train:0", "sampling_session_id": f"s:sample:{i}"}, "s:train:0", i))
        loop.step()
    assert [loop.backend.has_snapshot(f"s:sample:{i}") for i in range(1, count + 1)] == [False] * 2 + [True] * KEEP_PER_MODEL
    body = {"prompt_tokens": [1, 2], "num_samples": 1, "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
    add(loop, future("old", "sample", {**body, "weights_id": "s:sample:1"}),
        future("new", "sample", {**body, "weights_id": f"s:sample:{count}"}))
    for _ in range(5):
        loop.step()
    done = results(loop)
    assert done["old"].status == "failed" and "weights were released" in done["old"].error["message"]
    assert done["old"].error["category"] == "user"
    assert done["new"].status == "completed"


def test_engine_log_lines_name_the_request_id(loop: EngineLoop, caplog: pytest.LogCaptureFixture) -> None:
    """The X-Request-Id the API stored with a future (api/submit.py) is in the engine's lines about it: here a
    request that was running when an engine stopped, found again at recovery."""
    create(loop, "s", "m")
    interrupted = future("m:7", "optim_step", {"model_id": "m", "learning_rate": 1e-3}, model_id="m", seq_id=1)
    interrupted.status, interrupted.request_id = "running", "trace-7f3a"
    add(loop, interrupted)
    with caplog.at_level(logging.INFO, logger="skyrl_tx.engine"):
        loop.recover()
    assert any("m:7 request_id=trace-7f3a was interrupted" in r.getMessage() for r in caplog.records), caplog.text
