"""Colocated sampling over the data-parallel replicas: rank 0's SamplingShare hands each sample request to one replica
(a tensor-parallel group, or one rank) and each rank's ReplicaSampler decodes its replica's share with its own KV
cache, so a DP=8 server samples on all 8 devices instead of rank 0's alone.

Every replica already holds the same weights (training is mirrored) and every sampler snapshot (snapshot,
load_snapshot, load_frozen_model and remove_snapshot are mirrored while sampling is shared), so a request needs no
weight movement: only the request goes to its replica, and only its results come back. Both travel on the existing
control group (parallel/data_parallel_backend.py), in lock-step: a request is queued on rank 0 and sent with the next
decode step, which every rank runs on its own requests at once; the step's answer (finished results, streaming
progress, refused submissions) is gathered to rank 0 in the same exchange. A request's num_samples stay together on
one replica, so a seeded request draws the same tokens as in one process (csrc/sampling/generator.cpp seeds sample i
of a request from (seed, i) alone, whatever its batch or replica) and greedy decoding is batch-invariant as one
process's is. An unseeded request gets its seed from rank 0's single stream (settings.seed): each replica's own
stream starts at the same seed, so two replicas would otherwise draw the same "random" samples.
"""

from __future__ import annotations

import logging
import pickle
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from skyrl_tx.errors import ConflictError, InternalError
from skyrl_tx.types import FailedSample, SampleRequest, SampleResult

log = logging.getLogger("skyrl_tx.parallel")

SAMPLING_COMMAND = "_sampling_step"  # the control-group command a step travels as (never a backend method name)


def _portable(exc: BaseException) -> BaseException:
    """An error that survives the trip to rank 0 (pickled): the skyrl_tx errors and most others as they are."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception type that does not pickle: its text
        return InternalError(f"{type(exc).__name__}: {exc}")


@dataclass
class StepAnswer:
    """What one rank's step returns to rank 0 (every rank of a replica returns the same)."""

    refused: list[tuple[int, BaseException]] = field(default_factory=list)  # (sample id, its submission's error)
    finished: list[tuple[int, SampleResult]] = field(default_factory=list)
    progress: dict[int, list[list[int]]] = field(default_factory=dict)  # streaming requests: tokens so far
    error: BaseException | None = None  # the decode step itself failed

    def signature(self) -> tuple:
        """What a replica's ranks must agree on (cheap to compare)."""
        return (sorted(i for i, _ in self.refused), sorted(i for i, _ in self.finished),
                None if self.error is None else f"{type(self.error).__name__}: {self.error}")


class ReplicaSampler:
    """Every rank's side: submits its replica's new requests to its own backend, runs one decode step, and answers
    in rank 0's sample ids (the backend numbers its requests itself)."""

    def __init__(self, backend: Any, replica: int):
        self.backend, self.replica = backend, replica
        self._ids: dict[int, int] = {}  # the backend's id -> rank 0's
        self._streams: set[int] = set()  # rank 0's ids of streaming requests
        self.decoded = 0  # sequences this rank finished decoding (its replica's share)

    def step(self, submissions: Sequence[Sequence[tuple[int, SampleRequest]]]) -> StepAnswer:
        """submissions: per replica, the (sample id, request) pairs queued since the last step; this rank takes its
        replica's."""
        answer = StepAnswer()
        for sample_id, request in submissions[self.replica]:
            try:
                self._ids[self.backend.submit_sample(request)] = sample_id
            except Exception as exc:  # noqa: BLE001 - the request's own error (bad input, unknown weights)
                answer.refused.append((sample_id, _portable(exc)))
                continue
            if request.stream:
                self._streams.add(sample_id)
        if not self._ids:
            return answer
        try:
            finished = self.backend.sample_step()
        except Exception as exc:  # noqa: BLE001 - rank 0 decides (a broken group restarts everything)
            answer.error = _portable(exc)
            return answer
        for local_id, result in finished:
            sample_id = self._ids.pop(local_id, None)
            if sample_id is None:  # not submitted through the share (a direct backend.sample call's request)
                continue
            self._streams.discard(sample_id)
            self.decoded += len(result.sequences)
            answer.finished.append((sample_id, result))
        if self._streams:
            answer.progress = self.progress(self._streams)
        return answer

    def progress(self, sample_ids: Collection[int]) -> dict[int, list[list[int]]]:
        """Tokens so far of each of `sample_ids` (rank 0's ids) decoding here."""
        mine = {local_id: sample_id for local_id, sample_id in self._ids.items() if sample_id in sample_ids}
        return {mine[local_id]: tokens for local_id, tokens in self.backend.sample_progress(list(mine)).items()}


@dataclass
class _InFlight:
    replica: int
    weights_id: str
    sequences: int


class SamplingShare:
    """Rank 0's side: which replica decodes each request (the one with the fewest sequences in flight, taking turns
    among equals), and the exchange of each decode step. `exchange(submissions)` sends a step to every rank, runs
    rank 0's own and returns each replica's StepAnswer, its ranks' agreement checked (data_parallel_backend.py);
    `local` is rank 0's ReplicaSampler, stepped alone while no other replica has work (when its replica is rank 0
    alone: with tensor parallelism its ranks always step together)."""

    def __init__(self, local: ReplicaSampler, replicas: int, tensor_parallel: int, seed: int,
                 exchange: Callable[[list[list[tuple[int, SampleRequest]]]], list[StepAnswer]]):
        self._local, self._replicas, self._tp, self._exchange = local, replicas, tensor_parallel, exchange
        self._seeds = random.Random(seed)  # the unseeded requests' seeds: one stream, as one process has
        self._next_id = 0
        self._turn = 0
        self._queued: list[list[tuple[int, SampleRequest]]] = [[] for _ in range(replicas)]
        self._in_flight: dict[int, _InFlight] = {}
        self._progress: dict[int, list[list[int]]] = {}  # other replicas' streaming requests, as of the last step
        self._held: list[tuple[int, SampleResult]] = []  # finished in a step that also raised: handed out next time
        self.decoded = [0] * replicas  # sequences each replica returned

    def submit(self, request: SampleRequest) -> int:
        request = request.seeded_from(self._seeds)
        replica = self._route()
        sample_id, self._next_id = self._next_id, self._next_id + 1
        self._queued[replica].append((sample_id, request))
        self._in_flight[sample_id] = _InFlight(replica, request.weights_id, int(request.num_samples))
        return sample_id

    def _route(self) -> int:
        load = [0] * self._replicas
        for f in self._in_flight.values():
            load[f.replica] += f.sequences
        order = [(self._turn + i) % self._replicas for i in range(self._replicas)]
        replica = min(order, key=lambda r: load[r])  # the first of the least loaded from the turn on
        self._turn = (replica + 1) % self._replicas
        return replica

    def check_unused(self, weights_id: str, message: str) -> None:
        """ConflictError(message) while a request queued or decoding on any replica samples `weights_id`: removing
        those weights is refused on rank 0 before any rank changes, as the core refuses it in one process."""
        if any(f.weights_id == weights_id for f in self._in_flight.values()):
            raise ConflictError(message)

    def idle(self) -> bool:
        return not self._in_flight and not self._held

    def step(self) -> list[tuple[int, SampleResult]]:
        finished, self._held = self._held, []
        if not self._in_flight:
            return finished
        queued, self._queued = self._queued, [[] for _ in range(self._replicas)]
        if self._tp == 1 and all(f.replica == 0 for f in self._in_flight.values()):
            answers = [self._local.step(queued)]  # only rank 0 has work: no exchange
        else:
            answers = self._exchange(queued)
        errors = []
        for replica, answer in enumerate(answers):
            for sample_id, exc in answer.refused:
                self._in_flight.pop(sample_id, None)
                finished.append((sample_id, FailedSample(exc)))
            for sample_id, result in answer.finished:
                self._in_flight.pop(sample_id, None)
                self._progress.pop(sample_id, None)
                self.decoded[replica] += len(result.sequences)
                finished.append((sample_id, result))
            if replica:
                self._progress.update(answer.progress)
            if answer.error is not None:
                errors.append(answer.error)
        if errors:
            self._held = finished  # the other replicas' results are not lost with the raise
            raise errors[0]
        return finished

    def progress(self, sample_ids: Sequence[int]) -> dict[int, list[list[int]]]:
        """Streaming: tokens so far of each of `sample_ids` still decoding (rank 0's replica: read now; the others:
        as their last step reported)."""
        mine = {i for i in sample_ids if i in self._in_flight and self._in_flight[i].replica == 0}
        out = self._local.progress(mine) if mine else {}
        for sample_id in sample_ids:
            if sample_id in self._progress and sample_id in self._in_flight:
                out[sample_id] = self._progress[sample_id]
        return out
