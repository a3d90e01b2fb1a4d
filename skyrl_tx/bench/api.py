"""`python -m skyrl_tx.bench api`: what the HTTP API adds on top of the compute, through the real tinker SDK.

Method: the server (`python -m skyrl_tx.api`) runs in a subprocess on 127.0.0.1. The SDK times round trips of
small forward_backward, optim_step and sample calls (submit to `.result()`). The compute of each call is timed
on a NativeBackend in this process (same base model, same settings, same data, same thread count), and the
overhead of round trip i is rtt_i - median(compute); p50 and p99 are over i. The time the server adds (the
target) leaves out the SDK's own work: the part of each round trip spent outside its HTTP exchanges (building
requests, futures and results in Python; httpx's send is timed from the request to the read response body), so
server-added_i = rtt_i - sdk_outside_http_i - median(compute). The server's own futures table
splits each round trip into queue (stored -> claimed by the engine), engine (claimed -> done, compute included)
and the rest (HTTP, parsing and storing the request, long-poll wake-up, SDK). CPU time per call of the API
server, the engine and the client (SDK) processes is reported too (Linux /proc): on a shared or small machine it
is steadier than wall time, and it says which process the overhead is spent in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from skyrl_tx.bench.live_server import LiveServer, bench_server
from skyrl_tx.bench.report import write_json
from skyrl_tx.bench.timing import timed

RANK = 8
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12]
TRAIN_TOKENS = [5, 17, 300, 42, 7, 99, 1000, 12, 64, 128, 256, 3, 9, 27, 81, 243, 11]  # 16 predicted tokens
SAMPLE_TOKENS = 8
TARGET_P50_MS = 5.0


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads) from /proc; None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


@contextlib.contextmanager
def server(base_model: str, threads: int, timeout_s: float = 180.0) -> Iterator[LiveServer]:
    """The real server in a subprocess on a free port, with a fresh data directory."""
    with bench_server(base_model, name="bench api", env={"OMP_NUM_THREADS": str(threads)},
                      timeout_s=timeout_s) as live:
        yield live


class HttpExchangeTimer:
    """The HTTP exchanges of this process (httpx.AsyncClient.send, which returns once the response body is read), so
    a round trip splits into the SDK's own time and the time on the wire and in the server. Exchanges overlap (the
    SDK 0.38 sampler's retrieve_futures long poll runs beside the asample POST, and may have started before the call):
    `inside` counts the union of their intervals within a window, not their sum. The SDK's background calls (session
    heartbeats, telemetry) are left out."""

    BACKGROUND = ("heartbeat", "telemetry")

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []

    def inside(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which some exchange was in flight."""
        total, reach = 0.0, start
        for a, b in sorted(self.intervals):
            a, b = max(a, reach), min(b, end)
            if b > a:
                total, reach = total + (b - a), b
        return total

    @contextlib.contextmanager
    def installed(self) -> Iterator[HttpExchangeTimer]:
        import httpx

        original = httpx.AsyncClient.send
        timer = self

        async def send(client: httpx.AsyncClient, request: httpx.Request, **kwargs: Any) -> httpx.Response:
            start = time.perf_counter()
            try:
                return await original(client, request, **kwargs)
            finally:  # runs before the SDK sees the response, so before the timed call returns
                if not any(part in request.url.path for part in timer.BACKGROUND):
                    timer.intervals.append((start, time.perf_counter()))

        httpx.AsyncClient.send = send  # type: ignore[method-assign]
        try:
            yield self
        finally:
            httpx.AsyncClient.send = original  # type: ignore[method-assign]


def _engine_pid(url: str) -> int | None:
    with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=5) as response:
        return json.loads(response.read()).get("engine_pid")


class RoundTrips(NamedTuple):
    seconds: dict[str, list[float]]  # per call type: each round trip (submit to result)
    sdk_outside_http: dict[str, list[float]]  # per call type: the SDK's own part of each round trip
    cpu_ms: dict[str, dict[str, float]]  # per call type: CPU milliseconds per call of each process


def sdk_round_trips(live: LiveServer, base_model: str, warmup: int, reps: int) -> RoundTrips:
    """Round trips through the SDK, the SDK's own part of each, and CPU per call of each process (/proc)."""
    os.environ.update(TINKER_BASE_URL=live.url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
    import tinker
    from tinker import types

    pids = {"api_server": live.pid, "engine": _engine_pid(live.url)}

    def cpu_now() -> dict[str, float | None]:
        return {"client": time.process_time(),
                **{name: process_cpu_seconds(pid) if pid else None for name, pid in pids.items()}}

    datum = types.Datum(model_input=types.ModelInput.from_ints(TRAIN_TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TRAIN_TOKENS[1:], "weights": [1.0] * (len(TRAIN_TOKENS) - 1)})
    with tinker.ServiceClient(base_url=live.url) as service:
        trainer = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=0).result()
        sampler = trainer.save_weights_and_get_sampling_client(name="bench").result()
        prompt = types.ModelInput.from_ints(PROMPT)
        params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=1, stop=[])
        adam = types.AdamParams(learning_rate=1e-4)
        calls = {"forward_backward": lambda: trainer.forward_backward([datum], "cross_entropy").result(),
                 "optim_step": lambda: trainer.optim_step(adam).result(),
                 "sample": lambda: sampler.sample(prompt, 1, params).result()}
        rtt: dict[str, list[float]] = {}
        outside: dict[str, list[float]] = {}
        cpu: dict[str, dict[str, float]] = {}
        timer = HttpExchangeTimer()
        with timer.installed():
            for name, call in calls.items():
                timed(call, warmup, 0)
                before = cpu_now()
                rtt[name], outside[name] = [], []
                for _ in range(reps):
                    timer.intervals.clear()
                    start = time.perf_counter()
                    call()
                    end = time.perf_counter()
                    rtt[name].append(end - start)
                    outside[name].append(max(end - start - timer.inside(start, end), 0.0))
                after = cpu_now()
                cpu[name] = {proc: (after[proc] - before[proc]) / reps * 1e3 for proc in after
                             if after[proc] is not None and before[proc] is not None}
        return RoundTrips(rtt, outside, cpu)


def server_timings(data_dir: Path) -> dict[str, list[tuple[float, float, float]]]:
    """Per request type, in submission order: (created, started, completed) seconds from the server's own
    futures table (SQLite in its data directory): when the API stored it, the engine claimed it, it finished."""
    import sqlite3
    from datetime import datetime

    def seconds(text: str | None) -> float:
        return datetime.fromisoformat(text).timestamp() if text else float("nan")

    out: dict[str, list[tuple[float, float, float]]] = {}
    with contextlib.closing(sqlite3.connect(data_dir / "skyrl_tx.db")) as db:
        rows = db.execute("SELECT request_type, created_at, started_at, completed_at FROM futures "
                          "ORDER BY created_at").fetchall()
    for kind, created, started, completed in rows:
        out.setdefault(kind, []).append((seconds(created), seconds(started), seconds(completed)))
    return out


def direct_compute(base_model: str, warmup: int, reps: int) -> dict[str, list[float]]:
    """The same backend calls the engine makes for those requests, without HTTP, database or SDK."""
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.types import AdamParams, Datum, SampleRequest, SamplingParams, TrainRequest

    backend = NativeBackend.from_name(base_model)
    backend.create_model("bench", lora_rank=RANK, alpha=32.0, seed=0)
    backend.snapshot("bench", "bench@0")
    request = TrainRequest("bench", [Datum(TRAIN_TOKENS[:-1], {"target_tokens": TRAIN_TOKENS[1:],
                                                                "weights": [1.0] * (len(TRAIN_TOKENS) - 1)})])
    sample = SampleRequest(PROMPT, SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=1, stop=[]),
                           weights_id="bench@0")
    return {
        "forward_backward": timed(lambda: backend.forward_backward([request]), warmup, reps),
        "optim_step": timed(lambda: backend.optim_step("bench", AdamParams(learning_rate=1e-4)), warmup, reps),
        "sample": timed(lambda: backend.sample([sample]), warmup, reps),
    }


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(trips: RoundTrips, compute: dict[str, list[float]],
              timings: dict[str, list[tuple[float, float, float]]]) -> dict[str, dict[str, float]]:
    """Overhead percentiles per call: of the whole round trip, and the part the server adds (the round trip less
    the SDK's own time and the compute). Where the server's futures line up with the timed calls, also where the
    time went: queue (stored → claimed by the engine), engine (claimed → done, compute included) and outside
    the engine (HTTP, request parsing and storing, long-poll wake-up, SDK)."""
    out = {}
    for call, rtt in trips.seconds.items():
        base = statistics.median(compute[call])
        overhead = [t - base for t in rtt]
        sdk = trips.sdk_outside_http[call]
        server_added = [t - s - base for t, s in zip(rtt, sdk)]
        entry = {"round_trip_p50_ms": percentile(rtt, 0.5) * 1e3, "round_trip_p99_ms": percentile(rtt, 0.99) * 1e3,
                 "compute_p50_ms": base * 1e3, "overhead_p50_ms": percentile(overhead, 0.5) * 1e3,
                 "overhead_p99_ms": percentile(overhead, 0.99) * 1e3,
                 "sdk_outside_http_p50_ms": percentile(sdk, 0.5) * 1e3,
                 "server_added_p50_ms": percentile(server_added, 0.5) * 1e3,
                 "server_added_p99_ms": percentile(server_added, 0.99) * 1e3, "calls": len(rtt)}
        futures = timings.get(call, [])[-len(rtt):]
        if len(futures) == len(rtt):
            entry["queue_p50_ms"] = percentile([s - c for c, s, _ in futures], 0.5) * 1e3
            entry["engine_p50_ms"] = percentile([d - s for _, s, d in futures], 0.5) * 1e3
            outside = [t - (d - c) for t, (c, _, d) in zip(rtt, futures)]
            entry["outside_engine_p50_ms"] = percentile(outside, 0.5) * 1e3
        for proc, ms in trips.cpu_ms.get(call, {}).items():
            entry[f"{proc}_cpu_ms_per_call"] = ms
        out[call] = entry
    return out


def run_api(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench api", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the direct run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    with server(args.base_model, args.threads) as live:
        trips = sdk_round_trips(live, args.base_model, args.warmup, args.reps)
        timings = server_timings(live.data_dir)
    compute = direct_compute(args.base_model, args.warmup, args.reps)
    calls = summarize(trips, compute, timings)
    p50 = max(c["server_added_p50_ms"] for c in calls.values())
    round_trip_p50 = max(c["overhead_p50_ms"] for c in calls.values())
    report = {"benchmark": "api", "base_model": args.base_model, "threads": args.threads, "reps": args.reps,
              "method": __doc__.split("Method: ", 1)[1].strip().replace("\n", " "), "calls": calls,
              "targets": {"server_added_p50_ms": {"target": TARGET_P50_MS, "value": p50, "met": p50 <= TARGET_P50_MS}}}
    columns = [("round_trip_p50_ms", "round trip p50"), ("round_trip_p99_ms", "p99"), ("compute_p50_ms", "compute p50"),
               ("overhead_p50_ms", "overhead p50"), ("overhead_p99_ms", "overhead p99"),
               ("sdk_outside_http_p50_ms", "SDK's own p50"), ("server_added_p50_ms", "server-added p50"),
               ("server_added_p99_ms", "server-added p99"), ("queue_p50_ms", "queue p50"),
               ("engine_p50_ms", "engine p50"), ("outside_engine_p50_ms", "outside engine p50"),
               ("api_server_cpu_ms_per_call", "API CPU/call"), ("engine_cpu_ms_per_call", "engine CPU/call"),
               ("client_cpu_ms_per_call", "SDK CPU/call")]
    rows = [("call", *(label for _, label in columns))]
    for name, c in calls.items():
        rows.append((name, *(f"{c[k]:.2f} ms" if k in c else "-" for k, _ in columns)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"\nAPI overhead, tinker SDK -> {args.base_model} server on 127.0.0.1 ({args.reps} calls each)\n")
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    verdict = "met" if p50 <= TARGET_P50_MS else "MISSED"
    print(f"\nworst server-added p50 {p50:.2f} ms (target <= {TARGET_P50_MS:g} ms): {verdict}; worst round-trip "
          f"overhead p50 (SDK included) {round_trip_p50:.2f} ms")
    print("method: " + report["method"])
    if args.json:
        write_json(report, args.json)
        print(f"JSON report: {args.json}")
    return report
