"""Streaming samples (the OpenAI endpoint's stream: true): after each decode step the engine reports the tokens each
sample gained, before the sample's outcome, and those tokens join to exactly the stored result."""

from __future__ import annotations

from typing import Any

from skyrl_tx.engine.loop import EngineLoop

from engine_rows import add, future, results

PARAMS = {"max_tokens": 24, "temperature": 1.0, "seed": 11, "stop": []}


class Recorder:
    """A notify callable with report_progress, as the API's EngineEvents and the engine child's PipeEvents are."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def __call__(self, outcomes: list[Any]) -> None:
        self.events += [("outcome", o.id) for o in outcomes]

    def report_progress(self, items: list[tuple[str, list[list[int]]]]) -> None:
        self.events += [("progress", item) for item in items]


def test_stream_progress_precedes_the_outcome_and_joins_to_the_result(loop: EngineLoop) -> None:
    recorder = Recorder()
    streaming = EngineLoop(loop.backend, loop.sessions, loop.checkpointer, notify=recorder)
    body = {"prompt_tokens": [5, 6, 7], "num_samples": 2, "weights_id": "", "sampling_params": PARAMS}
    add(streaming, future("live", "sample", {**body, "stream": True}), future("quiet", "sample", body))
    for _ in range(200):
        streaming.step()
        if results(streaming)["live"].status == "completed" and results(streaming)["quiet"].status == "completed":
            break
    stored = results(streaming)["live"].result["sequences"]
    progress = [tokens for kind, item in recorder.events if kind == "progress" for fid, tokens in [item]
                if fid == "live"]
    assert not [item for kind, item in recorder.events if kind == "progress" and item[0] == "quiet"]
    assert len(progress) > 1, "expected several decode steps' worth of progress"  # one report per step with news
    outcome_at = recorder.events.index(("outcome", "live"))
    assert all(recorder.events.index(("progress", ("live", p))) < outcome_at for p in progress)
    for sample, seq in enumerate(stored):
        joined = [t for step in progress for t in (step[sample] if sample < len(step) else [])]
        assert joined == seq["tokens"][: len(joined)], sample
        assert len(joined) >= len(seq["tokens"]) - 1  # the last step's tokens arrive with the outcome at the latest
