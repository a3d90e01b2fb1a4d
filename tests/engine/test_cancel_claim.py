"""A request cancelled (api cancel_future's conditional UPDATE) between the engine's scan and its claim is never run,
and its seq_id does not hold up the model's later requests. Real core, real SQLite; the cancel is made to land in
exactly that window by running it just before the engine's claim statement executes."""

from __future__ import annotations

from datetime import datetime, timezone

from engine_rows import DATUM, add, create, future, results, stored_result
from sqlalchemy import event

from skyrl_tx.db import future_queries

FB_OTHER = {"input_tokens": [9, 8, 7, 6, 5], "loss_fn_inputs": {
    "target_tokens": {"dtype": "int64", "shape": [5], "values": [8, 7, 6, 5, 4]},
    "weights": {"dtype": "float32", "shape": [5], "values": [1.0] * 5}}}
CANCELLED = {"category": "user", "code": "cancelled", "message": "cancelled in the test"}


def fb(model: str, datum: dict) -> dict:
    return {"model_id": model, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [datum]}


def step(model: str) -> dict:
    return {"model_id": model, "adam_params": {"learning_rate": 0.05}}


def test_a_request_cancelled_after_the_scan_is_not_claimed_and_its_seq_id_is_used(loop) -> None:
    victim, reference = "a:train:0", "b:train:0"
    create(loop, "a", victim)
    create(loop, "b", reference)
    # The reference model runs the same requests without the cancelled one: seq 1, then the step.
    add(loop, future(f"{reference}:1", "forward_backward", fb(reference, DATUM), reference, 1),
        future(f"{reference}:2", "optim_step", step(reference), reference, 2))
    for _ in range(2):
        loop.step()
    add(loop, future(f"{victim}:1", "forward_backward", fb(victim, DATUM), victim, 1),
        future(f"{victim}:2", "forward_backward", fb(victim, FB_OTHER), victim, 2),
        future(f"{victim}:3", "optim_step", step(victim), victim, 3))

    cancelled: list[int] = []

    def cancel_before_claim(conn, clauseelement, multiparams, params, execution_options) -> None:
        rows = multiparams if isinstance(multiparams, list) else [multiparams or params]
        if clauseelement is future_queries.MARK_RUNNING and any(
                p.get("id_") == f"{victim}:2" for p in rows if isinstance(p, dict)) and not cancelled:
            # The scan has read seq 2 as pending; the client's cancel commits before the engine claims it.
            with loop.database.begin() as other:
                cancelled.append(other.execute(future_queries.CANCEL_PENDING, {
                    "id_": f"{victim}:2", "error_": CANCELLED, "now": datetime.now(timezone.utc)}).rowcount)

    event.listen(loop.database, "before_execute", cancel_before_claim)
    try:
        for _ in range(3):
            loop.step()
    finally:
        event.remove(loop.database, "before_execute", cancel_before_claim)

    assert cancelled == [1]  # the cancel won: the row was still pending when it ran
    done = results(loop)
    gone = done[f"{victim}:2"]
    assert (gone.status, gone.error, gone.attempts, gone.started_at) == ("failed", CANCELLED, 0, None)
    assert done[f"{victim}:1"].status == done[f"{victim}:3"].status == "completed"  # seq 3 did not wait for 2
    # The step saw exactly seq 1's gradients, as the reference's did: seq 2 never ran.
    assert stored_result(done[f"{victim}:3"])["metrics"] == stored_result(done[f"{reference}:2"])["metrics"]
    assert stored_result(done[f"{victim}:1"])["metrics"] == stored_result(done[f"{reference}:1"])["metrics"]


def test_a_cancel_after_the_claim_changes_nothing(loop) -> None:
    model = "a:train:0"
    create(loop, "a", model)
    add(loop, future(f"{model}:1", "forward_backward", fb(model, DATUM), model, 1))
    loop.step()
    with loop.database.begin() as db:
        assert db.execute(future_queries.CANCEL_PENDING, {
            "id_": f"{model}:1", "error_": CANCELLED, "now": datetime.now(timezone.utc)}).rowcount == 0
    done = results(loop)[f"{model}:1"]
    assert (done.status, done.error, done.attempts) == ("completed", None, 1)
