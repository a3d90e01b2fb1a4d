"""`python -m skyrl_tx.bench shared-cpu`: training-step latency of the README's Pig Latin loop when another process
holds a core, under torch's default thread pools and under the engine's thread policy (engine/threads.py).

Method: per policy, one live server (`python -m skyrl_tx.api`, engine as a child process) on 127.0.0.1 with a
fresh data directory and no thread settings in its environment (OMP_NUM_THREADS etc. removed, so the policy
decides; `torch` sets SKYRL_TX_THREADS=torch, the old behaviour). Through the tinker SDK, a LoRA training
client runs the quickstart's step (forward_backward on the 7 Pig Latin examples + optim_step, both awaited) in
rounds: a block of steps alone, then a block with one CPU-bound process beside it (a Python busy loop). The
servers of all policies stay up and their blocks alternate, so slow drift in the machine's load (other work on
a shared machine) hits every policy and load alike. Each block starts with untimed warm-up steps. Reported per
policy and load: step p50 / p90 over the timed steps. Target (policy `fit`): with the busy process, p90 <= 2x
p50 and p50 within 1.5x of the p50 without it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from skyrl_tx.bench.api import percentile
from skyrl_tx.bench.live_server import bench_server
from skyrl_tx.bench.report import write_json
from skyrl_tx.engine.threads import CHOSEN_ENV, POLICY_ENV, WAIT_ENV

POLICIES = {"torch": {POLICY_ENV: "torch"}, "fit": {}}  # extra server environment per policy
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", POLICY_ENV, CHOSEN_ENV, *WAIT_ENV)  # removed: the policy decides
EXAMPLES = [("banana split", "anana-bay plit-say"), ("quantum physics", "uantum-qay ysics-phay"),
            ("donut shop", "onut-day op-shay"), ("pickle jar", "ickle-pay ar-jay"),
            ("space exploration", "ace-spay exploration-way"), ("rubber duck", "ubber-ray uck-day"),
            ("coding wizard", "oding-cay izard-way")]  # examples/quickstart_pig_latin.py
MAX_P90_OVER_P50 = 2.0
MAX_BUSY_OVER_IDLE_P50 = 1.5


@contextlib.contextmanager
def server(base_model: str, policy_env: dict[str, str], timeout_s: float = 180.0) -> Iterator[tuple[str, Path]]:
    """The real server in a subprocess under one thread policy; yields its URL and log file."""
    with bench_server(base_model, name=f"bench shared-cpu ({policy_env or 'policy fit'})", env=policy_env,
                      drop_env=THREAD_ENV, timeout_s=timeout_s) as live:
        yield live.url, live.log_path


@contextlib.contextmanager
def busy_process() -> Iterator[None]:
    """One CPU-bound process (like `yes > /dev/null`) for the length of the block."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def engine_threads_line(log_path: Path) -> str:
    for line in log_path.read_text(errors="replace").splitlines():
        if "threads: " in line:
            return line.split("threads: ", 1)[1].strip()
    return "no thread log line (torch defaults)"


class PigLatinTrainer:
    """A LoRA training client on one live server, running the quickstart's training step."""

    def __init__(self, url: str, base_model: str, stack: contextlib.ExitStack):
        import tinker
        from tinker import types

        service = stack.enter_context(tinker.ServiceClient(base_url=url))
        self.trainer = service.create_lora_training_client(base_model=base_model, rank=8).result()
        tokenizer = self.trainer.get_tokenizer()
        self.data = []
        for english, pig in EXAMPLES:
            prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=True)
            completion = tokenizer.encode(f" {pig}\n\n", add_special_tokens=False)
            tokens, weights = prompt + completion, [0] * len(prompt) + [1] * len(completion)
            self.data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
                                         loss_fn_inputs={"weights": weights[1:], "target_tokens": tokens[1:]}))
        self.adam = types.AdamParams(learning_rate=1e-4)

    def step(self) -> float:
        """Seconds for one step: forward_backward and optim_step submitted, then both awaited."""
        start = time.perf_counter()
        fwdbwd = self.trainer.forward_backward(self.data, "cross_entropy")
        optim = self.trainer.optim_step(self.adam)
        fwdbwd.result()
        optim.result()
        return time.perf_counter() - start


def summarize(times: dict[str, list[float]], threads: str) -> dict[str, Any]:
    out: dict[str, Any] = {"engine_threads": threads}
    for load, values in times.items():
        out[load] = {"p50_s": percentile(values, 0.5), "p90_s": percentile(values, 0.9), "steps": len(values),
                     "steps_s": values}
    busy, idle = out["busy"], out["idle"]
    out["busy_p90_over_p50"] = busy["p90_s"] / busy["p50_s"]
    out["busy_over_idle_p50"] = busy["p50_s"] / idle["p50_s"]
    out["met"] = (out["busy_p90_over_p50"] <= MAX_P90_OVER_P50 and out["busy_over_idle_p50"] <= MAX_BUSY_OVER_IDLE_P50)
    return out


def run_policies(policies: list[str], base_model: str, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Every policy's server stays up; their blocks alternate (round by round, policy by policy), so load that
    other work puts on a shared machine hits each policy alike."""
    os.environ.update(TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
    with contextlib.ExitStack() as stack:
        servers = {p: stack.enter_context(server(base_model, POLICIES[p])) for p in policies}
        trainers = {p: PigLatinTrainer(url, base_model, stack) for p, (url, _) in servers.items()}
        times = {p: {"idle": [], "busy": []} for p in policies}
        for _ in range(rounds):
            for policy, trainer in trainers.items():
                for load in ("idle", "busy"):
                    with busy_process() if load == "busy" else contextlib.nullcontext():
                        for _ in range(warmup):
                            trainer.step()
                        times[policy][load].extend(trainer.step() for _ in range(steps))
        return {p: summarize(times[p], engine_threads_line(log_path)) for p, (_, log_path) in servers.items()}


def run_shared_cpu(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench shared-cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=["torch", "fit"])
    parser.add_argument("--rounds", type=int, default=2, help="idle block + busy block, repeated")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each block")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    results = run_policies(args.policies, args.base_model, args.rounds, args.steps, args.warmup)
    load_after = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    report = {"benchmark": "shared-cpu", "base_model": args.base_model, "cores": cores, "rounds": args.rounds,
              "steps_per_block": args.steps, "warmup": args.warmup, "loadavg_1m": [load_before, load_after],
              "method": __doc__.split("Method: ", 1)[1].strip().replace("\n", " "), "policies": results}
    print(f"\nPig Latin training step (forward_backward + optim_step) on {args.base_model}, {cores} cores, "
          f"{args.rounds} x {args.steps} steps per load; 1-min load average {load_before:.1f} before, "
          f"{load_after:.1f} after (other work on the machine counts too)\n")
    print(f"{'policy':<7} {'idle p50':>9} {'idle p90':>9} {'busy p50':>9} {'busy p90':>9} "
          f"{'busy p90/p50':>13} {'busy/idle p50':>14}  target  engine threads")
    for name, r in results.items():
        print(f"{name:<7} {r['idle']['p50_s'] * 1e3:7.1f}ms {r['idle']['p90_s'] * 1e3:7.1f}ms "
              f"{r['busy']['p50_s'] * 1e3:7.1f}ms {r['busy']['p90_s'] * 1e3:7.1f}ms {r['busy_p90_over_p50']:13.2f} "
              f"{r['busy_over_idle_p50']:14.2f}  {'met' if r['met'] else 'MISSED':<6}  {r['engine_threads']}")
    print(f"\ntarget: busy p90 <= {MAX_P90_OVER_P50:g}x busy p50 and busy p50 <= {MAX_BUSY_OVER_IDLE_P50:g}x idle p50")
    if args.json:
        write_json(report, args.json)
        print(f"JSON report: {args.json}")
    return report
