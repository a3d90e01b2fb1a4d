"""Builds a session's Perfetto trace from its requests' phase times (db/request_timings.py) and the API's own
moments (api/trace/ring.py).

Layout: one track per training client and per sampling client (and one for the session's own requests, e.g.
custom-loss creation), each with child "lane" tracks: a client pipelines requests, so their spans overlap, and
Perfetto nests slices on one track by time; each request goes to the first lane free at its start. A request is one
slice (received -> answered, or stored -> result stored where the API's ring does not know it) with its phases as
child slices, in order: storing the request, waiting for seq order, queued, computing, storing the result, waking
the API, answering. Counter tracks: requests in flight (stored, not yet finished), training / prefill / generation
tokens per second (per time bin), and each request's size in tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from skyrl_tx.api.trace.pftrace import TraceWriter
from skyrl_tx.api.trace.ring import ApiTimes
from skyrl_tx.db.request_timings import RequestTiming

PHASES = ("storing the request", "waiting for seq order", "queued", "computing", "storing the result",
          "waking the API", "answering")
TRAINING_TYPES = ("forward_backward", "forward")
BINS = 200  # tokens/s counters: the session's span cut into this many bins (at least MIN_BIN_S each)
MIN_BIN_S = 0.05
CLIENT_NAMES = {"training": "training client", "sampling": "sampling client", "session": "session"}


@dataclass(frozen=True)
class BuiltTrace:
    data: bytes
    spans: int  # requests drawn (one slice each, with its phases)
    total: int  # requests the session has
    truncated: bool


def _ns(t: datetime | float) -> int:
    return int((t.timestamp() if isinstance(t, datetime) else t) * 1e9)


def phase_points(r: RequestTiming, api: ApiTimes) -> list[tuple[str, int, int]]:
    """The request's phases as (name, begin ns, end ns), in order, each starting where the one before ended: the
    API's and the engine's clocks are one host's wall clock, and a reading a hair earlier than the one before (two
    processes) is moved up to it, so the phases tile the request's span without overlapping."""
    stored = _ns(r.stored)
    marks: list[tuple[str, int | None]] = [
        ("storing the request", _ns(api.received) if api.received is not None else None),
        ("waiting for seq order", stored),
        ("queued", _ns(r.ordered) if r.ordered is not None else None),
        ("computing", _ns(r.claimed) if r.claimed is not None else None),
        ("storing the result", _ns(r.computed) if r.computed is not None else None),
        ("waking the API", _ns(r.completed) if r.completed is not None else None),
        ("answering", _ns(api.woken) if api.woken is not None else None),
        ("", _ns(api.answered) if api.answered is not None else None)]  # the end of the last phase
    known = [(name, t) for name, t in marks if t is not None]
    out, last = [], known[0][1]
    for (name, begin), (_, end) in zip(known, known[1:]):
        begin = max(begin, last)
        end = max(end, begin)
        if name:
            # A mark that is missing merges its phase into the one before (e.g. no seq-order wait: stored ->
            # claimed is all "queued"): name the span by the phase whose mark began it.
            out.append((name, begin, end))
        last = end
    # "waiting for seq order" has a mark (stored) even without a wait: it is only a wait where `ordered` is known.
    return [(("queued" if name == "waiting for seq order" and r.ordered is None else name), b, e)
            for name, b, e in out]


def _request_name(r: RequestTiming) -> str:
    return f"{r.request_type} #{r.seq_id}" if r.seq_id is not None else r.request_type


def build_trace(session_id: str, requests: Sequence[RequestTiming], total: int, api_times: Callable[[str], ApiTimes],
                training_tokens: Mapping[str, int]) -> BuiltTrace:
    w = TraceWriter()
    next_uuid = iter(range(1, 1 << 62))
    clients: dict[tuple[str, str], tuple[int, list[tuple[int, int]]]] = {}  # -> (track, [(lane track, free at)])
    events: list[tuple[int, int, Callable[[], None]]] = []  # (ns, order, emit): packets in time order

    def later(ns: int, emit: Callable[[], None]) -> None:
        events.append((ns, len(events), emit))

    in_flight: list[tuple[int, int]] = []
    trained: list[tuple[int, int, int]] = []  # (begin ns, end ns, tokens)
    prefilled: list[tuple[int, int, int]] = []
    generated: list[tuple[int, int, int]] = []
    sizes: list[tuple[int, int]] = []
    for r in requests:
        key = (r.client_kind, r.client_id)
        if key not in clients:
            track = next(next_uuid)
            w.track(track, f"{CLIENT_NAMES[r.client_kind]} {r.client_id}")
            clients[key] = (track, [])
        client_track, lanes = clients[key]
        api = api_times(r.future_id)
        phases = phase_points(r, api)
        begin = phases[0][1] if phases else _ns(r.stored)
        end = phases[-1][2] if phases else begin
        lane = next((i for i, (_, free_at) in enumerate(lanes) if free_at <= begin), None)
        if lane is None:
            lane_track = next(next_uuid)
            w.track(lane_track, f"{CLIENT_NAMES[r.client_kind]} {r.client_id} · lane {len(lanes)}", client_track)
            lanes.append((lane_track, end))
            lane = len(lanes) - 1
        lane_track = lanes[lane][0]
        lanes[lane] = (lane_track, end)
        tokens = training_tokens.get(r.future_id, 0) if r.request_type in TRAINING_TYPES else r.prompt_tokens
        notes: list[tuple[str, int | float | str]] = [("future_id", r.future_id), ("status", r.status),
                                                      ("api_times", int(api.received is not None))]
        if r.seq_id is not None:
            notes.append(("seq_id", r.seq_id))
        if tokens:
            notes.append(("tokens", tokens))
        if r.generated_tokens:
            notes.append(("generated_tokens", r.generated_tokens))
        later(begin, lambda t=lane_track, b=begin, n=_request_name(r), a=notes, c=r.client_kind: w.begin(t, b, n, a, c))
        for name, b, e in phases:
            later(b, lambda t=lane_track, b=b, n=name: w.begin(t, b, n, (), "phase"))
            later(e, lambda t=lane_track, e=e: w.end(t, e))
        later(end, lambda t=lane_track, e=end: w.end(t, e))
        stored = _ns(r.stored)
        finished = _ns(r.completed) if r.completed is not None else None
        in_flight.append((stored, 1))
        if finished is not None:
            in_flight.append((finished, -1))
        compute_begin = _ns(r.claimed) if r.claimed is not None else None
        compute_end = _ns(r.computed or r.completed) if (r.computed or r.completed) is not None else None
        if compute_begin is not None and compute_end is not None:
            if r.request_type in TRAINING_TYPES and tokens:
                trained.append((compute_begin, compute_end, tokens))
            elif r.request_type == "sample":
                # The engine times no prefill of its own: a sample's prompt is prefilled as it joins the decode
                # batch, right after its claim, so its tokens count in the claim's bin.
                prefilled.append((compute_begin, compute_begin, r.prompt_tokens))
                generated.append((compute_begin, compute_end, r.generated_tokens))
        if tokens:
            sizes.append((stored, tokens))

    if requests:
        start = min(t for t, _ in in_flight)
        stop = max([t for t, _ in in_flight] + [e for _, e, _ in trained + generated])
        _counters(w, next_uuid, in_flight, trained, prefilled, generated, sizes, start, stop)
        if total > len(requests):
            notes_track = next(next_uuid)
            w.track(notes_track, "trace notes")
            w.begin(notes_track, start, f"truncated: the newest {len(requests)} of {total} requests are drawn")
            w.end(notes_track, start)
    for _, _, emit in sorted(events, key=lambda e: (e[0], e[1])):
        emit()
    return BuiltTrace(bytes(w), len(requests), total, total > len(requests))


def _counters(w: TraceWriter, uuids, in_flight, trained, prefilled, generated, sizes, start: int, stop: int) -> None:
    track = next(uuids)
    w.counter_track(track, "requests in flight")
    level = 0
    w.counter(track, start, 0)
    for t, delta in sorted(in_flight, key=lambda e: (e[0], -e[1])):
        level += delta
        w.counter(track, t, level)
    width = max((stop - start) / BINS, MIN_BIN_S * 1e9)
    bins = int((stop - start) / width) + 1
    for name, spans in (("training tokens/s", trained), ("prefill tokens/s", prefilled),
                        ("generation tokens/s", generated)):
        track = next(uuids)
        w.counter_track(track, name)
        per_bin = [0.0] * bins
        for b, e, tokens in spans:
            if e <= b:  # all in one bin
                per_bin[min(int((b - start) / width), bins - 1)] += tokens
                continue
            for i in range(int((b - start) / width), min(int((e - start) / width), bins - 1) + 1):
                lo, hi = start + i * width, start + (i + 1) * width
                per_bin[i] += tokens * max(min(e, hi) - max(b, lo), 0) / (e - b)
        for i, tokens in enumerate(per_bin):
            w.counter(track, int(start + i * width), tokens / (width / 1e9))
        w.counter(track, int(start + bins * width), 0)
    track = next(uuids)
    w.counter_track(track, "request size (tokens)")
    for t, tokens in sorted(sizes):
        w.counter(track, t, tokens)
