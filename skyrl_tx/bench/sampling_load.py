"""`python -m skyrl_tx.bench sampling-load`: many concurrent SDK sampling clients against one server, beside the
engine stepping the same load with no API in front.

Method: `--clients` tinker SamplingClients (64 by default, spread over `--processes` client processes so one GIL does
not pace them, each client on its own thread) loop `sample(prompt, max_tokens, num_samples=1)` for `--seconds`
against a live server (tiny-qwen3 by default). Reported: requests/s, and p50 / p90 / p99 of each request's round
trip. The peer, run in the same session: a NativeBackend in this process keeps the same number of requests in
flight in its continuous batch (a finished one is replaced at once, as a client would), so the ratio served /
in-process is the share of the engine's sampling rate that reaches clients through the SDK, HTTP, the database and
the long poll. Issue 42 names milestone 1's figure for 64 clients on this 2-core machine: 37.7 requests/s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from skyrl_tx.bench.api import percentile
from skyrl_tx.bench.live_server import bench_server

PROMPT = list(range(5, 13))  # 8 prompt tokens, as bench mixed uses


def _client_process(conn: Any, url: str, base_model: str, clients: int, max_tokens: int, nice: int) -> None:
    """`clients` sampling clients on their own threads; runs each `seconds` it is sent and answers the latencies
    of the requests that finished within it, until it is sent None."""
    os.nice(nice)
    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
    import tinker
    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    with tinker.ServiceClient() as service:
        samplers = [service.create_sampling_client(base_model=base_model).result() for _ in range(clients)]
        samplers[0].sample(prompt=prompt, sampling_params=params, num_samples=1).result()  # connections warm
        conn.send("ready")
        while (seconds := conn.recv()) is not None:
            stop, latencies = threading.Event(), [[] for _ in samplers]

            def loop(sampler: Any, out: list[float]) -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    sampler.sample(prompt=prompt, sampling_params=params, num_samples=1).result()
                    if not stop.is_set():  # a request that ends after the window does not count
                        out.append(time.monotonic() - started)

            threads = [threading.Thread(target=loop, args=(s, out)) for s, out in zip(samplers, latencies)]
            started = time.monotonic()
            for t in threads:
                t.start()
            time.sleep(seconds)
            stop.set()
            elapsed = time.monotonic() - started
            for t in threads:
                t.join()
            conn.send((elapsed, [x for out in latencies for x in out]))


def served(base_model: str, clients: int, processes: int, seconds: float, max_tokens: int,
           nice: int) -> dict[str, float]:
    """The SDK side: requests/s and round-trip percentiles of `clients` concurrent sampling clients."""
    context = multiprocessing.get_context("spawn")
    with bench_server(base_model, name="bench sampling-load") as live:
        shares = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
        workers = []
        for share in shares:
            ours, theirs = context.Pipe()
            process = context.Process(target=_client_process,
                                      args=(theirs, live.url, base_model, share, max_tokens, nice), daemon=True)
            process.start()
            workers.append((ours, process))
        try:
            for conn, _ in workers:
                if conn.recv() != "ready":
                    raise RuntimeError("a client process did not start")
            for conn, _ in workers:  # warm-up window, not reported
                conn.send(min(3.0, seconds))
            for conn, _ in workers:
                conn.recv()
            for conn, _ in workers:
                conn.send(seconds)
            answers = [conn.recv() for conn, _ in workers]
        finally:
            for conn, process in workers:
                conn.send(None)
                process.join(60)
    elapsed = max(a[0] for a in answers)
    latencies = [x for a in answers for x in a[1]]
    return {"requests_per_s": len(latencies) / elapsed, "requests": len(latencies),
            "p50_s": percentile(latencies, 0.5), "p90_s": percentile(latencies, 0.9),
            "p99_s": percentile(latencies, 0.99)}


def in_process(base_model: str, in_flight: int, seconds: float, max_tokens: int) -> dict[str, float]:
    """The peer: the engine's continuous batch kept at `in_flight` requests with nothing in front of it."""
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.types import SampleRequest, SamplingParams

    backend = NativeBackend.from_name(base_model)
    request = SampleRequest(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=1.0))
    for _ in range(in_flight):
        backend.submit_sample(request)

    def run(window: float) -> int:
        finished, deadline = 0, time.monotonic() + window
        while time.monotonic() < deadline:
            for _ in backend.sample_step():
                finished += 1
                backend.submit_sample(request)  # the client asks again at once
        return finished

    run(min(3.0, seconds))  # warm-up
    started = time.monotonic()
    finished = run(seconds)
    return {"requests_per_s": finished / (time.monotonic() - started), "requests": finished}


def run_sampling_load(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench sampling-load", description=__doc__.split("\n")[0])
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4, help="client processes the clients are spread over")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the measured window")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--client-nice", type=int, default=10,
                        help="niceness of the client processes (clients on other machines take no server CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.clients < 1 or not 1 <= args.processes <= args.clients:
        parser.error("--clients must be >= 1 and --processes between 1 and --clients")
    report = {"clients": args.clients, "max_tokens": args.max_tokens, "seconds": args.seconds,
              "served": served(args.base_model, args.clients, args.processes, args.seconds, args.max_tokens,
                               args.client_nice),
              "in_process": in_process(args.base_model, args.clients, args.seconds, args.max_tokens)}
    report["served_over_in_process"] = (report["served"]["requests_per_s"] / report["in_process"]["requests_per_s"]
                                        if report["in_process"]["requests_per_s"] else 0.0)
    s, p = report["served"], report["in_process"]
    print(f"{args.clients} sampling clients, max_tokens {args.max_tokens}, {args.seconds:.0f} s window")
    print(f"  through the SDK: {s['requests_per_s']:.1f} requests/s (p50 {s['p50_s']:.3f} s, p90 {s['p90_s']:.3f} s, "
          f"p99 {s['p99_s']:.3f} s; {s['requests']} requests)")
    print(f"  in-process engine, {args.clients} in flight: {p['requests_per_s']:.1f} requests/s")
    print(f"  served / in-process: {report['served_over_in_process']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    run_sampling_load(sys.argv[1:])
