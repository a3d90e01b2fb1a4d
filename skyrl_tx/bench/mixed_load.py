"""`python -m skyrl_tx.bench mixed`: training and sampling on one server; neither may starve the other.

Three phases against a live server (the tiny preset by default) through the tinker SDK, trainers and samplers each
in their own process: samplers alone, trainers alone (each looping forward_backward + optim_step), then both at once. Reports sampling requests/s and training
steps/s of the mixed phase as ratios of the phases alone, once per backend-config `sampling_share` asked for
(0 is the old schedule: one decode step per training pass). The goal: both ratios >= 0.5 at the default share.
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

from skyrl_tx.bench.api import _engine_pid, process_cpu_seconds
from skyrl_tx.bench.live_server import bench_server

TOKENS = list(range(5, 69))


def _loop_until(stop: threading.Event, counter: list[int], call) -> None:
    while not stop.is_set():
        call()
        counter[0] += 1


def _run_role(role: str, clients: list[Any], seconds: float, max_tokens: int) -> float:
    """Every client loops its call for `seconds` (one thread each); returns calls per second (training: steps)."""
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    adam = types.AdamParams(learning_rate=1e-4)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    prompt = types.ModelInput.from_ints(TOKENS[:8])

    def call(client: Any) -> None:
        if role == "train":
            client.forward_backward([datum] * 4, "cross_entropy").result()
            client.optim_step(adam).result()
        else:
            client.sample(prompt=prompt, sampling_params=params, num_samples=1).result()

    stop, counters = threading.Event(), [[0] for _ in clients]
    threads = [threading.Thread(target=_loop_until, args=(stop, counter, lambda c=client: call(c)))
               for client, counter in zip(clients, counters)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(c[0] for c in counters) / (time.monotonic() - started)


def _role_process(conn: Any, url: str, base_model: str, role: str, count: int, max_tokens: int,
                  nice: int) -> None:
    """One user population in its own process (as separate users are; one process would share one GIL): makes its
    clients, then runs each `seconds` it is sent and answers the rate, until it is sent None. At `nice` (default
    10): the load generators take the CPU the server leaves, as clients on other machines would, instead of
    taking turns with the engine on a small box (then the ratios measure the client processes' contention)."""
    os.nice(nice)
    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
    import tinker

    with tinker.ServiceClient() as service:
        if role == "train":
            clients = [service.create_lora_training_client(base_model=base_model, rank=8).result()
                       for _ in range(count)]
        else:
            clients = [service.create_sampling_client(base_model=base_model).result() for _ in range(count)]
        conn.send("ready")
        while (seconds := conn.recv()) is not None:
            conn.send(_run_role(role, clients, seconds, max_tokens))


def measure(base_model: str, share: float, trainers: int, samplers: int, seconds: float,
            max_tokens: int, client_nice: int = 10, device: str = "cpu") -> dict[str, Any]:
    config = {"sampling_share": share, "max_lora_adapters": max(trainers, 1), "device": device}
    context = multiprocessing.get_context("spawn")
    with bench_server(base_model, name="bench mixed", args=["--backend-config", json.dumps(config)]) as live:
        roles = {}
        for role, count in (("train", trainers), ("sample", samplers)):
            ours, theirs = context.Pipe()
            process = context.Process(target=_role_process, args=(theirs, live.url, base_model, role, count,
                                                                  max_tokens, client_nice), daemon=True)
            process.start()
            roles[role] = (ours, process)
        try:
            for conn, _ in roles.values():
                assert conn.recv() == "ready"

            pids = {"api": live.pid, "engine": _engine_pid(live.url),
                    **{f"{name}_clients": process.pid for name, (_, process) in roles.items()}}
            cpu: dict[str, dict[str, float]] = {}  # phase → process → CPU share of one core during the phase

            def phase(*names: str, length: float = seconds) -> dict[str, float]:
                before, started = {k: process_cpu_seconds(p) for k, p in pids.items() if p}, time.monotonic()
                for name in names:
                    roles[name][0].send(length)
                rates = {name: roles[name][0].recv() for name in names}
                elapsed = time.monotonic() - started
                cpu["+".join(names)] = {k: round((process_cpu_seconds(pids[k]) - v) / elapsed, 2)
                                        for k, v in before.items() if v is not None}
                return rates

            phase("train", "sample", length=min(seconds, 3.0))  # warm-up
            sample_alone = phase("sample")["sample"]
            train_alone = phase("train")["train"]
            mixed = phase("train", "sample")
        finally:
            for conn, process in roles.values():
                conn.send(None)
                process.join(60)
    train_mixed, sample_mixed = mixed["train"], mixed["sample"]
    return {"sampling_share": share, "client_nice": client_nice, "train_steps_per_s_alone": train_alone, "train_steps_per_s_mixed": train_mixed,
            "samples_per_s_alone": sample_alone, "samples_per_s_mixed": sample_mixed,
            "training_ratio": train_mixed / train_alone if train_alone else 0.0,
            "sampling_ratio": sample_mixed / sample_alone if sample_alone else 0.0,
            "cpu_cores_used": cpu}


def run_mixed(argv: list[str]) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench mixed", description=__doc__.split("\n")[0])
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--shares", default="0,0.5", help="comma-separated sampling_share values to compare")
    parser.add_argument("--trainers", type=int, default=8)
    parser.add_argument("--samplers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--client-nice", type=int, default=10,
                        help="niceness of the client processes (0: they compete with the server for the CPU)")
    parser.add_argument("--device", default="cpu", help="the server's device: cpu, cuda or cuda:N")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [measure(args.base_model, float(s), args.trainers, args.samplers, args.seconds, args.max_tokens,
                    args.client_nice, args.device)
            for s in args.shares.split(",")]
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"{'share':>6} {'train/s alone':>14} {'mixed':>8} {'ratio':>6} {'samples/s alone':>16} {'mixed':>8} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['sampling_share']:>6.2f} {r['train_steps_per_s_alone']:>14.2f} {r['train_steps_per_s_mixed']:>8.2f} "
              f"{r['training_ratio']:>6.2f} {r['samples_per_s_alone']:>16.2f} {r['samples_per_s_mixed']:>8.2f} "
              f"{r['sampling_ratio']:>6.2f}")
    for r in rows:  # where the machine's CPU went: on a small box the clients compete with the server for it
        print(f"share {r['sampling_share']:.2f}, CPU cores used per phase: {json.dumps(r['cpu_cores_used'])}")
    return rows


if __name__ == "__main__":
    run_mixed(sys.argv[1:])
