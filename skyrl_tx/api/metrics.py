"""Metrics: the server's Prometheus metrics (one CollectorRegistry per app), fed by the HTTP middleware, the engine's
notifications (finished futures with their queue / engine seconds) and its `stats` reports; GET /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import Engine, event

from skyrl_tx.api.errors import error_response
from skyrl_tx.api.http_metrics import HttpMetrics
from skyrl_tx.api.key_metrics import KeyMetrics
from skyrl_tx.api.principal import caller_of
from skyrl_tx.api.request_ids import RequestContext, install_log_context
from skyrl_tx.db.future_queries import QUEUE_DEPTH, FutureOutcome, Notify
from skyrl_tx.db.models import REQUEST_TYPES, FutureStatus
from skyrl_tx.engine.stats import counts_as_database_error

log = logging.getLogger("skyrl_tx.api")

METRICS_PATHS = ("/metrics", "/api/v1/metrics")
# Seconds, 1 ms to 10 min: a hot-path call is milliseconds, a large save or a long sample minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0, 600.0)
# Engine counters that arrive as totals since the engine started: /metrics adds their increase, so they stay
# monotonic across engine restarts.
ENGINE_TOTALS = ("tokens_trained", "tokens_sampled", "database_errors", "missed_wakeups", "sweeps")
QUEUE_STATES = (FutureStatus.PENDING.value, FutureStatus.RUNNING.value)


def outcome_label(o: FutureOutcome) -> str:
    if o.status == FutureStatus.COMPLETED.value:
        return "ok"
    return "user_error" if (o.error or {}).get("category") == "user" else "server_error"


class EngineEvents:
    """What the engine host calls: a Notify (long-polls first, then counters) with `report_stats` for the engine's
    periodic stats (engine/stats.py finds it on the notify callable, engine/process.py on on_finished)."""

    def __init__(self, metrics: Metrics, notify: Notify, progress: Any = None) -> None:
        self._metrics = metrics
        self._notify = notify
        if progress is not None:  # streaming samples' new tokens (engine/loop.py finds report_progress on us)
            self.report_progress = progress

    def __call__(self, outcomes: list[FutureOutcome]) -> None:
        self._notify(outcomes)
        self._metrics.observe_outcomes(outcomes)

    def report_stats(self, stats: dict[str, Any]) -> None:
        self._metrics.engine_stats(stats)


class Metrics:
    def __init__(self, database: Engine | None = None) -> None:
        self.registry = CollectorRegistry()  # per app: tests start several apps in one process
        r = self.registry
        self.http = HttpMetrics(LATENCY_BUCKETS)  # per request: plain dicts, not prometheus_client's locks
        r.register(self.http)
        self.keys = KeyMetrics(database)  # per API key: finished requests by outcome, tokens (api/key_metrics.py)
        r.register(self.keys)
        self.requests = Counter("skyrl_tx_requests", "Requests (futures) the engine finished, by request type and "
                                "outcome (ok, user_error, server_error)", ["type", "outcome"], registry=r)
        self.latency = Histogram("skyrl_tx_request_latency_seconds", "Seconds of a request the engine finished: "
                                 "phase queue = stored -> claimed by the engine, engine = claimed -> done, total = "
                                 "both", ["type", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_trained = Counter("skyrl_tx_tokens_trained", "Input tokens of forward_backward requests the "
                                      "engine ran", registry=r)
        self.tokens_sampled = Counter("skyrl_tx_tokens_sampled", "Tokens the engine generated for samples",
                                      registry=r)
        self.database_errors = Counter("skyrl_tx_database_errors", "Database errors (integrity errors of "
                                       "idempotent retries excluded), by process", ["process"], registry=r)
        # The hot path's guard (tests/api/test_metrics.py): work found by a poll interval instead of its wake-up.
        self.missed_wakeups = Counter("skyrl_tx_engine_missed_wakeups", "Requests the engine found by its idle poll "
                                      "interval after a wake-up was missed (should stay 0; --engine external has no "
                                      "wake-ups, so there it counts every request)", registry=r)
        self.sweeps = Counter("skyrl_tx_engine_sweeps", "Periodic sweeps (session expiry, checkpoint TTLs, futures "
                              "retention), run beside the engine loop", registry=r)
        self.long_poll_missed_wakeups = Counter(
            "skyrl_tx_long_poll_missed_wakeups", "retrieve_future long polls that found their future finished on a "
            "database recheck instead of being woken by the engine's notification (should stay 0)", registry=r)
        self.adapter_slots = Gauge("skyrl_tx_adapter_slots", "LoRA adapter slots (max_lora_adapters)", ["state"],
                                   registry=r)
        self.full_model_slots = Gauge("skyrl_tx_full_model_slots", "Full fine-tuning model copies "
                                      "(max_full_models)", ["state"], registry=r)
        self.kv_rows = Gauge("skyrl_tx_kv_cache_rows", "KV-cache rows (max_sampling_sequences): sequences decoding",
                             ["state"], registry=r)
        self.sequences_waiting = Gauge("skyrl_tx_sampling_sequences_waiting", "Sampled sequences submitted that "
                                       "wait for a KV-cache row", registry=r)
        self.snapshots = Gauge("skyrl_tx_sampler_snapshots_resident", "Sampler snapshots the backend holds (frozen "
                               "weights sampling uses; full fine-tuning ones spilled to disk not counted)", registry=r)
        self.snapshots_max = Gauge("skyrl_tx_sampler_snapshots_max_resident", "LoRA sampler snapshots kept in "
                                   "device slots before older ones move to host memory (max_resident_snapshots)",
                                   registry=r)
        self.engine_started = Gauge("skyrl_tx_engine_start_time_seconds", "When the engine that reports now "
                                    "started (Unix time): a change is an engine restart", registry=r)
        self.stats_at: float | None = None  # monotonic time of the engine's last stats report
        self._engine_run: str | None = None
        self._engine_totals: dict[str, int] = {}
        self._database = database
        self._runner: Any = None
        r.register(_ScrapeTime(self))
        for process in ("api", "engine"):
            self.database_errors.labels(process)  # both series exist from the start (rate() needs a first 0)
        if database is not None:
            event.listen(database, "handle_error", self._on_database_error)

    # ---- inputs -------------------------------------------------------------------------------------------------
    def _on_database_error(self, context: Any) -> None:
        if counts_as_database_error(context):
            self.database_errors.labels("api").inc()

    def observe_outcomes(self, outcomes: Iterable[FutureOutcome]) -> None:
        outcomes = list(outcomes)
        self.keys.observe(outcomes, outcome_label)
        for o in outcomes:
            self.requests.labels(o.request_type, outcome_label(o)).inc()
            if o.queue_s is not None and o.engine_s is not None:
                self.latency.labels(o.request_type, "queue").observe(o.queue_s)
                self.latency.labels(o.request_type, "engine").observe(o.engine_s)
                self.latency.labels(o.request_type, "total").observe(o.queue_s + o.engine_s)

    def engine_stats(self, stats: dict[str, Any]) -> None:
        """An engine report (engine/stats.py EngineStats.snapshot): gauges are set, totals added as increases."""
        self.stats_at = time.monotonic()
        if stats.get("run") != self._engine_run:  # a new engine: its totals start from 0
            self._engine_run, self._engine_totals = stats.get("run"), {}
            if isinstance(stats.get("started_at"), (int, float)):
                self.engine_started.set(stats["started_at"])
        for name in ENGINE_TOTALS:
            value = stats.get(name)
            if not isinstance(value, int):
                continue
            increase = value - self._engine_totals.get(name, 0)
            self._engine_totals[name] = value
            if increase > 0:
                target = self.database_errors.labels("engine") if name == "database_errors" else getattr(self, name)
                target.inc(increase)
        for gauge, used, most in ((self.adapter_slots, "adapters_used", "adapters_max"),
                                  (self.full_model_slots, "full_models_used", "full_models_max"),
                                  (self.kv_rows, "kv_rows_used", "kv_rows_max")):
            if used in stats and most in stats:
                gauge.labels("used").set(stats[used])
                gauge.labels("free").set(max(stats[most] - stats[used], 0))
        if "sequences_waiting" in stats:
            self.sequences_waiting.set(stats["sequences_waiting"])
        if "snapshots" in stats:
            self.snapshots.set(stats["snapshots"])
            self.snapshots_max.set(stats.get("snapshots_max_resident", 0))

    def engine_events(self, notify: Notify, progress: Any = None) -> EngineEvents:
        return EngineEvents(self, notify, progress)

    # ---- the app ------------------------------------------------------------------------------------------------
    def install(self, app: FastAPI, runner: Any) -> None:
        """GET /metrics (and /api/v1/metrics), the request-id / access-log / HTTP-metrics middleware, the request id
        in log lines. Call it last in create_app: the middleware must be the outermost (it sees every answer)."""
        self._runner = runner
        install_log_context()

        async def metrics(request: Request) -> Response:
            who = caller_of(request)
            if who is not None and not who.admin:  # with --auth keys: every key's numbers are the operator's to read
                return error_response(403, "permission_denied", f"metrics: API key {who.name!r} is not an admin key; "
                                      "only an admin key may read /metrics (an operator makes one with `skyrl-tx keys "
                                      "create --name NAME --admin`)")
            body = await asyncio.to_thread(generate_latest, self.registry)  # the queue depth reads the database
            return Response(body, media_type=CONTENT_TYPE_LATEST)

        for path in METRICS_PATHS:
            app.add_api_route(path, metrics, methods=["GET"], include_in_schema=False)
        app.add_middleware(RequestContext, observe=self.http.observe)

    def queue_depth(self) -> dict[tuple[str, str], int]:
        if self._database is None:
            return {}
        with self._database.connect() as db:
            return {(t, s): n for t, s, n in db.execute(QUEUE_DEPTH)}


class _ScrapeTime:
    """Values read when /metrics is scraped, not per request: queue depth (one GROUP BY over the unfinished
    futures), engine restarts and readiness, the age of the engine's last stats report."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:  # no database read at registration
        return [GaugeMetricFamily("skyrl_tx_queue_depth", ""), CounterMetricFamily("skyrl_tx_engine_restarts", ""),
                GaugeMetricFamily("skyrl_tx_engine_ready", ""),
                GaugeMetricFamily("skyrl_tx_engine_stats_age_seconds", "")]

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        try:
            depth = m.queue_depth()
        except Exception:  # noqa: BLE001 - counted by the database error hook; the rest of /metrics still answers
            log.warning("/metrics: the queue depth could not be read", exc_info=True)
        else:
            family = GaugeMetricFamily("skyrl_tx_queue_depth", "Requests stored and not finished, by type and state "
                                       "(pending: waiting for the engine, running: claimed by it)",
                                       labels=["type", "state"])
            for request_type in sorted(REQUEST_TYPES | {t for t, _ in depth}):
                for state in QUEUE_STATES:
                    family.add_metric([request_type, state], depth.get((request_type, state), 0))
            yield family
        runner = m._runner
        if runner is None:
            return
        restarts = CounterMetricFamily("skyrl_tx_engine_restarts", "Engine process restarts after it died")
        restarts.add_metric([], getattr(runner, "restarts", 0))
        yield restarts
        ready = runner.ready.is_set() and runner.failed is None
        yield GaugeMetricFamily("skyrl_tx_engine_ready", "1 once the engine has loaded the base model and "
                                "recovered", value=1 if ready else 0)
        if m.stats_at is not None:
            yield GaugeMetricFamily("skyrl_tx_engine_stats_age_seconds", "Seconds since the engine's last stats "
                                    "report (about 1 s while it runs; more during a long step)",
                                    value=time.monotonic() - m.stats_at)
