"""Full fine-tuning sampler snapshots stay within their memory budget: the least recently sampled ones move to
disk, and sampling an evicted one gives exactly the tokens and logprobs it gave before it was evicted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.config import BackendSettings
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.errors import InvalidArgumentError

from engine_rows import DATUM, FULL_MODEL, SEEDED_SAMPLE, add, full_model_loop, future, results

MODEL, SAMPLE = FULL_MODEL, SEEDED_SAMPLE


@pytest.fixture()
def loop(tmp_path, tiny_model_dir) -> Iterator[EngineLoop]:
    with full_model_loop(tmp_path, tiny_model_dir("tiny-qwen3")) as loop:
        yield loop


def run(loop: EngineLoop, *rows) -> dict:
    add(loop, *rows)
    ids = [r.id for r in rows]
    for _ in range(2000):
        done = results(loop)
        if all(done[i].status in ("completed", "failed") for i in ids):
            return {i: done[i] for i in ids}
        loop.step()
        assert within_budget(loop)
    raise AssertionError("requests did not finish")


def within_budget(loop: EngineLoop) -> bool:
    memory = loop.checkpointer.snapshot_memory
    resident = [sid for sid in memory._resident if loop.backend.has_snapshot(sid)]
    assert len(resident) == len(memory._resident)  # the accounting matches the backend
    return memory.resident_bytes <= memory.budget


def sample(loop: EngineLoop, fid: str, weights_id: str) -> list:
    done = run(loop, future(fid, "sample", {**SAMPLE, "weights_id": weights_id}))[fid]
    assert done.status == "completed", done.error
    return [(s["tokens"], s["logprobs"]) for s in done.result["sequences"]]


def train_step(loop: EngineLoop, seq: int) -> int:
    fb = {"model_id": MODEL, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    done = run(loop, future(f"{MODEL}:{seq}", "forward_backward", fb, MODEL, seq),
               future(f"{MODEL}:{seq + 1}", "optim_step", {"model_id": MODEL, "adam_params": {"learning_rate": 0.05}},
                      MODEL, seq + 1))
    assert all(f.status == "completed" for f in done.values())
    return seq + 2


def test_snapshots_past_the_budget_go_to_disk_and_sample_the_same_when_loaded_back(loop: EngineLoop) -> None:
    memory = loop.checkpointer.snapshot_memory
    one = memory.size_of(loop.backend.trainable_state(MODEL))
    memory.budget = int(2.5 * one)  # room for two frozen copies
    seq, before = 1, {}
    names = [f"s:sample:{i}" for i in range(4)]
    path = TinkerPath(MODEL, "sampler_weights", "named")
    for i, name in enumerate(names + [str(path)]):
        seq = train_step(loop, seq)  # every snapshot holds different weights
        body = {"model_id": MODEL, "sampling_session_id": name} if i < len(names) else \
            {"model_id": MODEL, "path": name}
        saved = run(loop, future(f"{MODEL}:{seq}", "save_weights_for_sampler", body, MODEL, seq))
        assert saved[f"{MODEL}:{seq}"].status == "completed"
        seq += 1
        before[name] = sample(loop, f"before:{i}", name)
        assert within_budget(loop) and len(memory._resident) <= 2
    assert len({str(v) for v in before.values()}) == len(before)  # the snapshots really differ
    assert not loop.backend.has_snapshot(names[0])  # the oldest ones were evicted ...
    assert not loop.backend.has_snapshot(names[1])
    for i, name in enumerate(names + [str(path)]):  # ... and sample as before when loaded back (named: from disk)
        assert sample(loop, f"after:{i}", name) == before[name]
        assert loop.backend.has_snapshot(name) and within_budget(loop)


def test_a_snapshot_larger_than_the_budget_is_a_clear_error(loop: EngineLoop) -> None:
    memory = loop.checkpointer.snapshot_memory
    memory.budget = memory.size_of(loop.backend.trainable_state(MODEL)) // 2
    done = run(loop, future(f"{MODEL}:1", "save_weights_for_sampler",
                            {"model_id": MODEL, "sampling_session_id": "s:sample:big"}, MODEL, 1))
    assert done[f"{MODEL}:1"].status == "completed"  # kept on disk only
    failed = run(loop, future("big", "sample", {**SAMPLE, "weights_id": "s:sample:big"}))["big"]
    assert failed.status == "failed" and "snapshot_memory_mb" in failed.error["message"]
    assert memory.resident_bytes == 0


def test_snapshot_memory_is_a_backend_config_key() -> None:
    assert BackendSettings.from_json('{"snapshot_memory_mb": 512}').snapshot_memory_mb == 512
    with pytest.raises(InvalidArgumentError, match="snapshot_memory_mb"):
        BackendSettings.from_json('{"snapshot_memory_mb": -1}')


def test_snapshots_serving_samples_stay_and_a_new_one_waits_on_disk(loop: EngineLoop) -> None:
    memory = loop.checkpointer.snapshot_memory
    memory.budget = int(2.5 * memory.size_of(loop.backend.trainable_state(MODEL)))
    seq = 1
    for name in ("s:sample:0", "s:sample:1"):
        seq = train_step(loop, seq)
        run(loop, future(f"{MODEL}:{seq}", "save_weights_for_sampler", {"model_id": MODEL, "sampling_session_id": name},
                         MODEL, seq))
        seq += 1
    long = {**SAMPLE, "num_samples": 1, "sampling_params": {"max_tokens": 600, "temperature": 0.0}}
    add(loop, future("long:0", "sample", {**long, "weights_id": "s:sample:0"}),
        future("long:1", "sample", {**long, "weights_id": "s:sample:1"}))
    loop.step()  # both start decoding
    seq = train_step(loop, seq)
    assert {results(loop)[i].status for i in ("long:0", "long:1")} == {"running"}, "the samples ended too soon"
    saved = run(loop, future(f"{MODEL}:{seq}", "save_weights_for_sampler",
                             {"model_id": MODEL, "sampling_session_id": "s:sample:2"}, MODEL, seq))
    assert saved[f"{MODEL}:{seq}"].status == "completed"
    assert {results(loop)[i].status for i in ("long:0", "long:1")} == {"running"}, "the samples ended too soon"
    assert loop.backend.has_snapshot("s:sample:0") and loop.backend.has_snapshot("s:sample:1")
    assert not loop.backend.has_snapshot("s:sample:2") and memory.holds("s:sample:2")  # on disk for now
    run(loop, future("l0", "sample", {**SAMPLE, "weights_id": "s:sample:0"}))  # lets the long ones finish too
    for _ in range(2000):
        if all(results(loop)[i].status == "completed" for i in ("long:0", "long:1")):
            break
        loop.step()
    assert sample(loop, "new", "s:sample:2")  # loads, evicting the least recently used idle snapshot
    assert loop.backend.has_snapshot("s:sample:2") and within_budget(loop)
