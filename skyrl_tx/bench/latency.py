"""`python -m skyrl_tx.bench latency`: the step-latency tail of a small training loop, idle and beside a CPU hog.

Method: the README's Pig Latin loop (4 examples, LoRA rank 32, tiny-qwen3) runs `--steps` forward_backward +
optim_step round trips through the tinker SDK against a live server, once on an otherwise idle machine and once
beside `--hogs` busy-looping processes. Each step splits into phases from the server's own futures table: queue
(the API stored the request -> the engine claimed it), engine (claimed -> its result stored) and outside (the rest of
the round trip: HTTP, parsing and storing the request, the long poll's wake-up, the SDK), for each of the step's two
requests. The peer is the same step on an in-process backend (no HTTP, database or SDK), run in the same session.
Reported: p50 / p90 / p99 of each, and p90 / p50 and p99 / p50 of the step (the issue's targets: 2x and 4x); with
--steps 2000 or more, also the median step of each thousand (is a step's cost independent of the futures before it?).
Each request's own phases come from the server's per-request records (GET /api/v1/sessions/{id}/request_timings,
the ones the session trace export draws): received -> stored (storing the request), waiting for seq order, queued
(-> claimed), computing, storing the result, result stored -> the API's long poll woken, woken -> answered; p50 /
p90 / p99 of each, per request type.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from skyrl_tx.api.trace.build import PHASES
from skyrl_tx.bench.api import percentile, server, server_timings
from skyrl_tx.bench.report import write_json

EXAMPLES = [("banana split", "anana-bay plit-say"), ("quantum physics", "uantum-qay ysics-phay"),
            ("donut shop", "onut-day op-shay"), ("pickle jar", "ickle-pay ar-jay")]
RANK = 32
HISTORY_BLOCK = 1000  # --steps of 2000 and more also report each thousand steps' median (two requests per step)


def _hog() -> None:
    while True:  # a busy loop, as `yes > /dev/null` is
        pass


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_hog, daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join(5)


def _datums(tokenizer: Any) -> list[Any]:
    from tinker import types

    out = []
    for english, pig in EXAMPLES:
        prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=True)
        completion = tokenizer.encode(f" {pig}\n\n", add_special_tokens=False)
        tokens, weights = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"weights": weights[1:], "target_tokens": tokens[1:]}))
    return out


Example = tuple[list[int], list[int], list[float]]  # a datum's input tokens, target tokens and weights


def sdk_steps(url: str, base_model: str, steps: int, warmup: int) -> tuple[list[float], list[Example], str]:
    """Round-trip seconds of each step, the step's datums (for the in-process peer), and the session's id."""
    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
    import tinker
    from tinker import types

    with tinker.ServiceClient(base_url=url) as service:
        client = service.create_lora_training_client(base_model=base_model, rank=RANK, seed=0).result()
        data = _datums(client.get_tokenizer())
        adam = types.AdamParams(learning_rate=1e-4)
        seconds = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            forward_backward = client.forward_backward(data, "cross_entropy")
            optim = client.optim_step(adam)
            forward_backward.result()
            optim.result()
            if step >= warmup:
                seconds.append(time.perf_counter() - start)
        return seconds, [(d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist(),
                          d.loss_fn_inputs["weights"].tolist()) for d in data], service.holder.get_session_id()


def in_process_steps(base_model: str, examples: list[Example], steps: int, warmup: int) -> list[float]:
    """The same step on a NativeBackend in this process: the engine's compute with nothing in front of it."""
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.bench.timing import timed
    from skyrl_tx.types import AdamParams, Datum, TrainRequest

    data = [Datum(inputs, {"target_tokens": targets, "weights": weights}) for inputs, targets, weights in examples]
    backend = NativeBackend.from_name(base_model)
    backend.create_model("bench", lora_rank=RANK, seed=0)

    def step() -> None:
        backend.forward_backward([TrainRequest("bench", data)])
        backend.optim_step("bench", AdamParams(learning_rate=1e-4))

    return timed(step, warmup, steps)


def _stats(values: list[float]) -> dict[str, float]:
    return {f"p{int(q * 100)}_ms": percentile(values, q) * 1e3 for q in (0.5, 0.9, 0.99)}


def phases(seconds: list[float], data_dir: Path, steps: int) -> dict[str, dict[str, float]]:
    """Per-phase percentiles of the last `steps` steps, from the futures table (one forward_backward and one
    optim_step per step)."""
    timings = server_timings(data_dir)
    fb, opt = timings.get("forward_backward", [])[-steps:], timings.get("optim_step", [])[-steps:]
    series = {"step": seconds}
    if len(fb) == len(opt) == len(seconds):
        for name, rows in (("forward_backward", fb), ("optim_step", opt)):
            series[f"{name} queue"] = [s - c for c, s, _ in rows]
            series[f"{name} engine"] = [d - s for _, s, d in rows]
        series["outside the engine"] = [t - ((fd - fc) + max(od - fd, 0.0))
                                        for t, (fc, _, fd), (_, _, od) in zip(seconds, fb, opt)]
    out: dict[str, Any] = {name: _stats(values) for name, values in series.items()}
    if len(seconds) >= 2 * HISTORY_BLOCK:  # per-step cost against history: each block of steps' medians
        starts = range(0, len(seconds) - HISTORY_BLOCK + 1, HISTORY_BLOCK)
        out["by history"] = {name: [percentile(values[i:i + HISTORY_BLOCK], 0.5) * 1e3 for i in starts]
                             for name, values in series.items()}
    return out


def request_phases(url: str, session_id: str, steps: int) -> dict[str, dict[str, float]]:
    """Per request type of the step, each phase's percentiles over the last `steps` requests (the server's records:
    engine times from the futures table, the API's own from its in-memory ring)."""
    request = urllib.request.Request(f"{url}/api/v1/sessions/{session_id}/request_timings?limit=10000",
                                     headers={"X-API-Key": "tml-bench"})
    with urllib.request.urlopen(request, timeout=60) as response:
        rows = json.load(response)["requests"]
    out: dict[str, dict[str, float]] = {}
    for kind in ("forward_backward", "optim_step"):
        mine = [r["phases_s"] for r in rows if r["request_type"] == kind][-steps:]
        for phase in PHASES:  # a phase not recorded for a request is left out (no seq-order wait: 0 s)
            values = [p.get(phase, 0.0) if phase == "waiting for seq order" else p[phase] for p in mine
                      if phase in p or phase == "waiting for seq order"]
            out[f"{kind}: {phase}"] = _stats(values) if values else {}
        claimed = [p.get("waiting for seq order", 0.0) + p["queued"] for p in mine if "queued" in p]
        out[f"{kind}: stored -> claimed"] = _stats(claimed) if claimed else {}
    return out


def run_latency(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hogs", type=int, default=1, help="busy-looping processes beside the second run (0: skip)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    runs: dict[str, Any] = {}
    examples: list[Example] = []
    for label, hog_count in (("idle", 0), (f"{args.hogs} CPU hog(s)", args.hogs)):
        if label != "idle" and not args.hogs:
            continue
        with hogs(hog_count), server(args.base_model, 1) as live:
            seconds, examples, session_id = sdk_steps(live.url, args.base_model, args.steps, args.warmup)
            runs[label] = phases(seconds, live.data_dir, args.steps)
            runs[label].update(request_phases(live.url, session_id, args.steps))
    runs["in-process engine (peer)"] = {"step": _stats(in_process_steps(args.base_model, examples, args.steps,
                                                                        args.warmup))}
    report = {"benchmark": "latency", "base_model": args.base_model, "steps": args.steps, "runs": runs,
              "method": __doc__.split("Method: ", 1)[1].strip().replace("\n", " ")}
    for label, table in runs.items():
        step = table["step"]
        print(f"\n{label}: step p50 {step['p50_ms']:.1f} ms, p90 {step['p90_ms']:.1f} ms, p99 {step['p99_ms']:.1f} ms "
              f"(p90/p50 {step['p90_ms'] / step['p50_ms']:.2f}, p99/p50 {step['p99_ms'] / step['p50_ms']:.2f})")
        for phase, stats in table.items():
            if phase == "by history":
                print(f"  median of each {HISTORY_BLOCK} steps, in order:")
                for name, medians in stats.items():
                    print(f"    {name:<24} " + " ".join(f"{m:7.2f}" for m in medians) + " ms")
            elif phase != "step" and stats:
                print(f"  {phase:<40} p50 {stats['p50_ms']:7.2f}  p90 {stats['p90_ms']:7.2f}  "
                      f"p99 {stats['p99_ms']:7.2f} ms")
    if args.json:
        write_json(report, args.json)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    run_latency(sys.argv[1:])
