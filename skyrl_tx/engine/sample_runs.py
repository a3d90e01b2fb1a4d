"""SampleRuns: the samples running on the engine's backend: their submission, decode steps and streamed tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from skyrl_tx.db.future_queries import FutureRow
from skyrl_tx.engine import executor, snapshots
from skyrl_tx.engine.checkpointing import Checkpointer

# (future, result, error) per finished future, stored in one transaction (EngineLoop._finish_many)
FinishMany = Callable[[list[tuple[FutureRow, Any, "dict[str, Any] | None"]]], None]


class SampleRuns:
    """The running samples of one engine loop, by backend sample id. Only the engine loop's thread uses it."""

    def __init__(self, backend: Any, checkpointer: Checkpointer, finish_many: FinishMany,
                 error: Callable[[BaseException], dict[str, Any]],
                 report_progress: Callable[[list[tuple[str, list[list[int]]]]], None] | None):
        self.backend, self.checkpointer = backend, checkpointer
        self._finish_many, self._error = finish_many, error
        # Streaming samples (the OpenAI endpoint's stream: true): after each decode step, the tokens each sample
        # gained go to `report_progress([(future id, [new tokens per sample])])` where the notify callable has one.
        self._report_progress = report_progress
        self.running: dict[int, FutureRow] = {}  # backend sample id → its (detached) future
        self._streams: dict[int, list[int]] = {}  # backend sample id → tokens already reported, per sample

    def __bool__(self) -> bool:
        return bool(self.running)

    def submit(self, f: FutureRow) -> None:
        """One claimed sample joins the running batch; its failure is stored on the future, never raised."""
        try:
            weights_id = f.request.get("weights_id", "")
            if ":sample:" in weights_id and not self.checkpointer.has_snapshot(weights_id):
                raise snapshots.released_error(weights_id)
            self.checkpointer.ensure_snapshot(weights_id)
            backend_id = self.backend.submit_sample(executor.sample_request(f.request))
            self.running[backend_id] = f
            if f.request.get("stream") and self._report_progress is not None and hasattr(self.backend,
                                                                                          "sample_progress"):
                self._streams[backend_id] = []
        except Exception as exc:  # noqa: BLE001 - stored on the future, never raised into the loop
            self._finish_many([(f, None, self._error(exc))])

    def advance(self) -> bool:
        """One decode step; the samples it finished are stored together."""
        if not self.running:
            return False
        done = []
        for backend_id, result in self.backend.sample_step():
            self._streams.pop(backend_id, None)
            f = self.running.pop(backend_id, None)
            if f is not None and getattr(result, "error", None) is not None:  # types.FailedSample
                done.append((f, None, self._error(result.error)))
            elif f is not None:
                done.append((f, executor.sample_result(result, f.request), None))
        if done:  # every sample that finished in this step: one transaction, one notification
            self._finish_many(done)
        if self._streams:
            self._report_stream_progress()
        return True

    def _report_stream_progress(self) -> None:
        """The tokens each streaming sample gained in this step (its final result still comes as its outcome)."""
        assert self._report_progress is not None  # only then are streams kept
        items = []
        for backend_id, so_far in self.backend.sample_progress(list(self._streams)).items():
            sent = self._streams[backend_id]
            sent.extend([0] * (len(so_far) - len(sent)))
            new = [tokens[already:] for tokens, already in zip(so_far, sent)]
            if any(new):
                items.append((self.running[backend_id].id, new))
                self._streams[backend_id] = [len(tokens) for tokens in so_far]
        if items:
            self._report_progress(items)
