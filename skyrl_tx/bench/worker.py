"""One side of one workload in a fresh process: builds it, then times repetitions on request and reports peak memory.

Protocol (JSON lines): the worker prints {"ready": ...} once built and warmed up; each "rep" (or, for sampling,
"first_token") line on stdin runs one timed repetition and answers {"seconds": s}; "done" answers
{"memory": ...} and exits. The parent alternates
repetitions of the two sides, so load drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from skyrl_tx.engine.threads import POLICY_ENV, wait_env


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--side", choices=["skyrl_tx", "hf_peft"], required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=None, help="sampling: tokens per sequence override")
    parser.add_argument("--backend-config", default="{}", help="skyrl_tx side: extra BackendSettings (JSON)")
    args = parser.parse_args(argv)
    if os.environ.get(POLICY_ENV) != "torch":  # as in the engine: OpenMP threads sleep, read when torch loads
        os.environ.update(wait_env(os.environ))

    import torch

    torch.set_num_threads(args.threads)
    from pathlib import Path

    from skyrl_tx.bench import hf_side, skyrl_side
    from skyrl_tx.bench.configs import CONFIGS

    side = skyrl_side if args.side == "skyrl_tx" else hf_side
    side.preload()
    cuda = args.device != "cpu"
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    baseline_rss = _rss_bytes()  # after imports: only what building and running the workload adds counts
    extra = {"backend_overrides": json.loads(args.backend_config)} if args.side == "skyrl_tx" else {}
    prepared = side.build(args.workload, Path(args.model_dir), CONFIGS[args.config], args.device, args.new_tokens,
                          **extra)
    runs = {"rep": prepared.run, "first_token": prepared.run_first_token}
    warm = []
    for _ in range(args.warmup):
        start = time.perf_counter()
        prepared.run()
        warm.append(time.perf_counter() - start)
    _emit({"ready": True, "tokens": prepared.tokens, "warmup_seconds": warm})
    for line in sys.stdin:
        command = line.strip()
        if runs.get(command) is not None:
            start = time.perf_counter()
            runs[command]()
            _emit({"seconds": time.perf_counter() - start})
        elif command == "done":
            memory = {"peak_rss_delta_bytes": max(_maxrss_bytes() - baseline_rss, 0)}
            if cuda:
                memory["peak_gpu_bytes"] = int(torch.cuda.max_memory_allocated())
            _emit({"memory": memory})
            return
        else:
            _emit({"error": f"unknown command {command!r}"})


if __name__ == "__main__":
    main()
