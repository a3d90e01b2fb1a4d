"""Training does not starve sampling: after each training pass the engine decodes for the backend-config
`sampling_share` of device time before it runs the next pass (share 0: one decode step per pass).

The engine's clock is a test clock that only the backend calls advance (a pass costs PASS_S, a decode step STEP_S),
so the schedule the fair-share logic produces is exact on any machine, however busy: the test asserts the count of
decode steps between training passes, never a measured time. The device-time split under real load is measured by
`python -m skyrl_tx.bench mixed`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from skyrl_tx.engine import decode_share
from skyrl_tx.engine.decode_share import MAX_DECODE_CREDIT_S
from skyrl_tx.engine.loop import EngineLoop

from engine_rows import DATUM, add, create, future, results

MODEL = "s:train:0"
PASS_S = 1.0
STEP_S = 0.125  # binary-exact, so the decode credit is paid off without rounding: 1.0 s owed = 8 steps
SAMPLES = 4


class EngineClock:
    """Stands in for the `time` module the engine loop's share of decoding reads (engine/decode_share.py: it calls only
    time.perf_counter)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def schedule(loop: EngineLoop, monkeypatch: pytest.MonkeyPatch, share: float, passes: int = 4,
             pass_s: float = PASS_S) -> list[int]:
    """Decode steps between consecutive training passes, while a trainer sends its next forward_backward as soon as
    the last one finished and SAMPLES samples decode throughout."""
    clock = EngineClock()
    monkeypatch.setattr(decode_share, "time", clock)
    calls: list[str] = []

    def ticking(kind: str, fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
        def run(*args: Any) -> Any:  # the real backend call, then the device time it is said to have taken
            result = fn(*args)
            clock.now += seconds
            calls.append(kind)
            return result
        return run

    monkeypatch.setattr(loop.backend, "forward_backward", ticking("train", loop.backend.forward_backward, pass_s))
    monkeypatch.setattr(loop.backend, "sample_step", ticking("decode", loop.backend.sample_step, STEP_S))
    loop.sampling_share = share
    create(loop, "s", MODEL)
    prompt = {"prompt_tokens": [5, 6, 7], "num_samples": 1, "weights_id": ""}
    add(loop, *[future(f"sample-{i}", "sample", {**prompt, "sampling_params": {
        "max_tokens": 1000, "temperature": 1.0, "seed": i}}) for i in range(SAMPLES)])
    loop.step()
    fb = {"model_id": MODEL, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    for seq_id in range(1, passes + 1):
        add(loop, future(f"{MODEL}:{seq_id}", "forward_backward", fb, MODEL, seq_id))
        for _ in range(1000):  # a bound, so a scheduler that never trains again fails instead of hanging
            if results(loop)[f"{MODEL}:{seq_id}"].status == "completed":
                break
            loop.step()
        else:
            raise AssertionError(f"pass {seq_id} never ran: {calls}")
    assert all(results(loop)[f"sample-{i}"].status == "running" for i in range(SAMPLES)), \
        "a sample finished early: the schedule is only defined while samples decode throughout"
    trains = [i for i, kind in enumerate(calls) if kind == "train"]
    assert len(trains) == passes, calls  # one batched pass per forward_backward, none rerun
    return [b - a - 1 for a, b in zip(trains, trains[1:])]


@pytest.mark.parametrize("share, steps", [(0.5, 8), (0.75, 24)])
def test_each_pass_is_followed_by_its_share_of_decoding(loop: EngineLoop, monkeypatch: pytest.MonkeyPatch,
                                                        share: float, steps: int) -> None:
    """A pass of PASS_S owes PASS_S * share / (1 - share) of decoding (0.5: as long as the pass; 0.75: three times
    as long), paid before the trainer's next pass runs."""
    assert steps * STEP_S == PASS_S * share / (1 - share)
    assert schedule(loop, monkeypatch, share) == [steps] * 3


def test_share_zero_is_one_decode_step_per_training_pass(loop: EngineLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer schedule: without a share, a training pass is followed by one decode step only."""
    assert schedule(loop, monkeypatch, 0.0) == [1] * 3


def test_a_long_pass_owes_at_most_the_credit_cap(loop: EngineLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """A very long pass (here 4x the cap) makes the next pass wait for MAX_DECODE_CREDIT_S of decoding, no more."""
    steps = int(MAX_DECODE_CREDIT_S / STEP_S)
    assert schedule(loop, monkeypatch, 0.5, passes=3, pass_s=4 * MAX_DECODE_CREDIT_S) == [steps] * 2
