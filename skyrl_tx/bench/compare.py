"""Runs every workload on both sides (each in its own fresh worker process), alternating their repetitions."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from skyrl_tx.bench import workloads as wl
from skyrl_tx.bench.configs import BenchConfig

SIDES = ("skyrl_tx", "hf_peft")


@dataclasses.dataclass
class RunOptions:
    config: BenchConfig
    model_dir: Path
    device: str
    threads: int
    warmup: int
    reps: int
    workloads: tuple[str, ...] = wl.WORKLOADS
    log: Any = sys.stderr
    backend_config: str = "{}"  # JSON: extra BackendSettings for the skyrl_tx side


class Worker:
    """A `python -m skyrl_tx.bench.worker` process speaking the JSON-lines protocol."""

    def __init__(self, side: str, workload: str, opts: RunOptions):
        args = [sys.executable, "-m", "skyrl_tx.bench.worker", "--side", side, "--workload", workload,
                "--config", opts.config.name, "--model-dir", str(opts.model_dir), "--device", opts.device,
                "--threads", str(opts.threads), "--warmup", str(opts.warmup), "--backend-config", opts.backend_config]
        # Same thread count for both sides, set before torch starts its pools.
        env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads), "MKL_NUM_THREADS": str(opts.threads),
               "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
        self.side, self.workload = side, workload
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"bench worker {self.side}/{self.workload} exited with code {code} "
                               "(see its stderr above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"bench worker {self.side}/{self.workload}: {reply['error']}")
        return reply

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def finish(self) -> dict[str, Any]:
        memory = self.ask("done")["memory"]
        self.proc.wait()
        return memory

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def run_workload(workload: str, opts: RunOptions) -> dict[str, dict[str, Any]]:
    """Per side: median seconds per repetition, tokens, every repetition, peak memory (and, for sampling, the
    median time of the one-new-token variant). Workers are built one after the other, then alternate."""
    workers: dict[str, Worker] = {}
    try:
        for side in SIDES:
            print(f"  {workload}: building {side}", file=opts.log, flush=True)
            workers[side] = Worker(side, workload, opts)
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        first: dict[str, list[float]] = {s: [] for s in SIDES}
        for rep in range(opts.reps):
            order = SIDES if rep % 2 == 0 else SIDES[::-1]  # ABBA: neither side always runs second
            for side in order:
                times[side].append(workers[side].ask("rep")["seconds"])
                if not wl.is_training(workload):
                    first[side].append(workers[side].ask("first_token")["seconds"])
        out = {}
        for side in SIDES:
            result: dict[str, Any] = {"tokens": workers[side].ready["tokens"], "median_s": _median(times[side]),
                                      "reps_s": times[side], "memory": workers[side].finish()}
            if first[side]:
                result["first_token_median_s"] = _median(first[side])
            out[side] = result
        return out
    finally:
        for worker in workers.values():
            worker.kill()


def run_all(opts: RunOptions) -> dict[str, dict[str, dict[str, Any]]]:
    results = {}
    for workload in opts.workloads:
        print(f"workload {workload}", file=opts.log, flush=True)
        results[workload] = run_workload(workload, opts)
    return results
