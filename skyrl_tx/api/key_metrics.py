"""KeyMetrics: /metrics per API key (its id, never the secret): requests the engine finished by type and outcome
(user and server errors included), and tokens trained, prefilled and sampled. Counted in memory from what the API has
at hand (the datums and prompt it accepted, the outcome the engine hands it); a request's key is its session's owner,
read once per session. Label values are bounded: keys are made by the operator, and past MAX_KEYS more are "other"."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from sqlalchemy import Engine, select

from skyrl_tx.db.future_queries import FutureOutcome
from skyrl_tx.db.models import FutureStatus, SessionRecord

MAX_KEYS = 1000  # distinct key labels; beyond, "other" (a bound on the series, never reached with real key counts)
MAX_PENDING = 100_000  # accepted requests whose tokens wait for their outcome; beyond, the oldest are dropped
LOCAL = "local"  # the label of --auth none's one owner
UNATTRIBUTED = "none"  # the label of requests of no session
REQUESTS = "skyrl_tx_key_requests"
TOKENS = "skyrl_tx_key_tokens"


def session_of(future_id: str) -> str:
    """Every SDK future id starts with its session's id: <session>:train:<n>:<seq>, <session>:sample:<n>:<seq>, ..."""
    return future_id.split(":", 1)[0]


class KeyMetrics:
    """A collector of the app's CollectorRegistry (api/metrics.py)."""

    def __init__(self, database: Engine | None) -> None:
        self._database = database
        self._lock = threading.Lock()  # outcomes arrive on the engine host's thread, acceptances on the API's
        self._owners: dict[str, str] = {}  # session id -> key label
        self._pending: dict[str, tuple[str, int]] = {}  # future id -> (token kind, tokens) until its outcome
        self._requests: dict[tuple[str, str, str], int] = {}  # (key, type, outcome)
        self._tokens: dict[tuple[str, str], int] = {}  # (key, trained | prefilled | sampled)
        self._keys: set[str] = set()  # labels in use

    def accepted(self, future_id: str, kind: str, tokens: int) -> None:
        """A forward / forward_backward (kind "trained": its input tokens) or a sample ("prefilled": its prompt)
        was stored; its tokens count once it completes."""
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._pending.pop(next(iter(self._pending)))
            self._pending[future_id] = (kind, tokens)

    def _owner(self, session_id: str) -> str:
        owner = self._owners.get(session_id)
        if owner is not None or self._database is None:
            return owner or LOCAL
        with self._database.connect() as db:
            row = db.execute(select(SessionRecord.owner_key_id).where(SessionRecord.id == session_id)).first()
        # No session: a request of no SDK session (the OpenAI-compatible routes' samples, which record no owner).
        owner = UNATTRIBUTED if row is None else row.owner_key_id or LOCAL
        if len(self._owners) >= 10 * MAX_KEYS:
            self._owners.clear()
        self._owners[session_id] = owner
        return owner

    def _label(self, owner: str) -> str:
        if owner not in self._keys:
            if len(self._keys) >= MAX_KEYS:
                return "other"
            self._keys.add(owner)
        return owner

    def observe(self, outcomes: Iterable[FutureOutcome], outcome_label: Any) -> None:
        for o in outcomes:
            try:
                key = self._owner(session_of(o.id))
            except Exception:  # noqa: BLE001 - a database hiccup costs a label, never the notification
                key = "unknown"
            with self._lock:
                key = self._label(key)
                counted = (key, o.request_type, outcome_label(o))
                self._requests[counted] = self._requests.get(counted, 0) + 1
                pending = self._pending.pop(o.id, None)
                if o.status != FutureStatus.COMPLETED.value:
                    continue
                if pending is not None:
                    self._add(key, *pending)
                if o.request_type == "sample" and isinstance(o.result, dict):
                    self._add(key, "sampled", sum(len(s.get("tokens") or []) for s in o.result.get("sequences") or []))

    def _add(self, key: str, kind: str, tokens: int) -> None:
        self._tokens[(key, kind)] = self._tokens.get((key, kind), 0) + tokens

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(REQUESTS, ""), CounterMetricFamily(TOKENS, "")]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            requests, tokens = dict(self._requests), dict(self._tokens)
        family = CounterMetricFamily(REQUESTS, "Requests the engine finished, by API key id ('local' without keys, "
                                     "'none' for requests of no session), request type and outcome (ok, "
                                     "user_error, server_error)",
                                     labels=["key_id", "type", "outcome"])
        for labels, n in sorted(requests.items()):
            family.add_metric(list(labels), n)
        yield family
        family = CounterMetricFamily(TOKENS, "Tokens of completed requests by API key id: trained (forward and "
                                     "forward_backward inputs), prefilled (sample prompts), sampled (generated)",
                                     labels=["key_id", "kind"])
        for labels, n in sorted(tokens.items()):
            family.add_metric(list(labels), n)
        yield family
