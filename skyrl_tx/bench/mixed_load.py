"""`python -m skyrl_tx.bench mixed`: training and sampling on one server; neither may starve the other.

Three phases against a live server (the tiny preset by default) through the tinker SDK: samplers alone, trainers
alone (each looping forward_backward + optim_step), then both at once. Reports sampling requests/s and training
steps/s of the mixed phase as ratios of the phases alone, once per backend-config `sampling_share` asked for
(0 is the old schedule: one decode step per training pass). The goal: both ratios >= 0.5 at the default share.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from skyrl_tx.bench.live_server import bench_server

TOKENS = list(range(5, 69))


def _loop_until(stop: threading.Event, counter: list[int], call) -> None:
    while not stop.is_set():
        call()
        counter[0] += 1


def _phase(trainers: list[Any], samplers: list[Any], seconds: float, max_tokens: int) -> tuple[float, float]:
    """Runs the given clients for `seconds`; returns (training steps/s, sampling requests/s)."""
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    adam = types.AdamParams(learning_rate=1e-4)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    prompt = types.ModelInput.from_ints(TOKENS[:8])

    def train(client) -> None:
        client.forward_backward([datum] * 4, "cross_entropy").result()
        client.optim_step(adam).result()

    stop, threads = threading.Event(), []
    steps, samples = [[0] for _ in trainers], [[0] for _ in samplers]
    for client, counter in zip(trainers, steps):
        threads.append(threading.Thread(target=_loop_until, args=(stop, counter, lambda c=client: train(c))))
    for client, counter in zip(samplers, samples):
        threads.append(threading.Thread(target=_loop_until, args=(
            stop, counter, lambda c=client: c.sample(prompt=prompt, sampling_params=params, num_samples=1).result())))
    for t in threads:
        t.start()
    started = time.monotonic()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    return sum(c[0] for c in steps) / elapsed, sum(c[0] for c in samples) / elapsed


def measure(base_model: str, share: float, trainers: int, samplers: int, seconds: float,
            max_tokens: int) -> dict[str, float]:
    import tinker

    config = {"sampling_share": share, "max_lora_adapters": max(trainers, 1)}
    with bench_server(base_model, name="bench mixed", args=["--backend-config", json.dumps(config)]) as live:
        os.environ.update(TINKER_BASE_URL=live.url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
        with tinker.ServiceClient() as service:
            training = [service.create_lora_training_client(base_model=base_model, rank=8).result()
                        for _ in range(trainers)]
            sampling = [service.create_sampling_client(base_model=base_model) for _ in range(samplers)]
            _phase(training[:1], sampling[:1], min(seconds, 3.0), max_tokens)  # warm-up
            _, sample_alone = _phase([], sampling, seconds, max_tokens)
            train_alone, _ = _phase(training, [], seconds, max_tokens)
            train_mixed, sample_mixed = _phase(training, sampling, seconds, max_tokens)
    return {"sampling_share": share, "train_steps_per_s_alone": train_alone, "train_steps_per_s_mixed": train_mixed,
            "samples_per_s_alone": sample_alone, "samples_per_s_mixed": sample_mixed,
            "training_ratio": train_mixed / train_alone if train_alone else 0.0,
            "sampling_ratio": sample_mixed / sample_alone if sample_alone else 0.0}


def run_mixed(argv: list[str]) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench mixed", description=__doc__.split("\n")[0])
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--shares", default="0,0.5", help="comma-separated sampling_share values to compare")
    parser.add_argument("--trainers", type=int, default=8)
    parser.add_argument("--samplers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [measure(args.base_model, float(s), args.trainers, args.samplers, args.seconds, args.max_tokens)
            for s in args.shares.split(",")]
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"{'share':>6} {'train/s alone':>14} {'mixed':>8} {'ratio':>6} {'samples/s alone':>16} {'mixed':>8} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['sampling_share']:>6.2f} {r['train_steps_per_s_alone']:>14.2f} {r['train_steps_per_s_mixed']:>8.2f} "
              f"{r['training_ratio']:>6.2f} {r['samples_per_s_alone']:>16.2f} {r['samples_per_s_mixed']:>8.2f} "
              f"{r['sampling_ratio']:>6.2f}")
    return rows


if __name__ == "__main__":
    run_mixed(sys.argv[1:])
