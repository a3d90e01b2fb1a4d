"""Command line: `python -m skyrl_tx.bench [compute]` (skyrl_tx vs HF + PEFT), `... api` (API overhead),
`... shared-cpu` (step latency beside a busy process, per thread policy), `... data-parallel` (step, collective time
and bytes per data-parallel layout), `... packing` (mixed-length training, packed against padded), `... saves` (another
user's sampling rate while a checkpoint is saved) and the other modes below."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from skyrl_tx.bench import workloads as wl
from skyrl_tx.bench.configs import CONFIGS, default_config
from skyrl_tx.engine.threads import choose_threads


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def _compute_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench",
                                description="skyrl_tx vs Hugging Face transformers + PEFT on the same work.")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--config", choices=sorted(CONFIGS),
                   help="model + workload sizes (default: cpu, or qwen3-0.6b on GPU)")
    p.add_argument("--threads", type=int,
                   help="torch threads for both sides (default: the engine's choice, skyrl_tx/engine/threads.py)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per side and workload")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per side and workload (median reported)")
    p.add_argument("--workloads", nargs="+", choices=wl.WORKLOADS,
                   help=f"default: {' '.join(wl.CPU_WORKLOADS)} on cpu; all on a GPU")
    p.add_argument("--json", type=Path, help="also write the full report here")
    p.add_argument("--backend-config", default="{}",
                   help="extra skyrl_tx --backend-config keys as JSON, e.g. '{\"cuda_graphs\": false}'")
    p.add_argument("--peak-bandwidth-tbs", type=float, help="device memory bandwidth in TB/s (default: GPU table)")
    p.add_argument("--peak-tflops", type=float, help="device peak TFLOP/s in the benchmark dtype (default: GPU table)")
    return p


def run_compute(argv: list[str]) -> dict:
    import torch

    from skyrl_tx.bench.compare import RunOptions, run_all
    from skyrl_tx.bench.configs import model_dir
    from skyrl_tx.bench.report import build_report, format_table, write_json
    from skyrl_tx.bench.roofline import ModelShape, device_peaks

    args = _compute_parser().parse_args(argv)
    cfg = CONFIGS[args.config or default_config(args.device)]
    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is visible to torch")
    if args.threads:
        threads, threads_policy = args.threads, "--threads"
    else:  # what an engine on this host and device would run
        choice = choose_threads(args.device)
        threads = choice.intra_op or torch.get_num_threads()
        threads_policy = f"{choice.source}: {choice.reason}"
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else _cpu_name()
    peaks = device_peaks(device_name, args.peak_tflops and args.peak_tflops * 1e12,
                         args.peak_bandwidth_tbs and args.peak_bandwidth_tbs * 1e12)
    print(f"preparing model {cfg.name} ({cfg.dtype}) ...", file=sys.stderr, flush=True)
    path = model_dir(cfg)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    shape = ModelShape.of(cfg.preset, vocab)
    workloads = tuple(args.workloads or wl.default_workloads(args.device))
    raw = run_all(RunOptions(cfg, path, args.device, threads, args.warmup, args.reps, workloads,
                             backend_config=args.backend_config))
    meta = {"device": args.device, "device_name": device_name, "threads": threads, "threads_policy": threads_policy,
            "torch": torch.__version__,
            "backend_config": json.loads(args.backend_config),
            "warmup": args.warmup, "reps": args.reps,
            "peak_flops": peaks.flops or 0.0, "peak_bandwidth_bytes_per_s": peaks.bandwidth or 0.0}
    if not peaks.flops:
        del meta["peak_flops"]
    if not peaks.bandwidth:
        del meta["peak_bandwidth_bytes_per_s"]
    report = build_report(raw, cfg, shape, peaks, meta)
    print(f"\nskyrl_tx vs HF+PEFT on {device_name} ({args.device}, {threads} threads: {threads_policy}), "
          f"model {cfg.name} "
          f"({shape.matmul_params / 1e6:.1f}M matmul params, {cfg.dtype}); median of {args.reps}\n")
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"\nJSON report: {args.json}")
    return report


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "api":
        from skyrl_tx.bench.api import run_api

        run_api(argv[1:])
        return
    if argv and argv[0] == "shared-cpu":
        from skyrl_tx.bench.shared_cpu import run_shared_cpu

        run_shared_cpu(argv[1:])
        return
    if argv and argv[0] == "mixed":
        from skyrl_tx.bench.mixed_load import run_mixed

        run_mixed(argv[1:])
        return
    if argv and argv[0] == "prefix-cache":
        from skyrl_tx.bench.prefix_cache import run_prefix_cache

        run_prefix_cache(argv[1:])
        return
    if argv and argv[0] == "gemm-share":
        from skyrl_tx.bench.gemm_share import run_gemm_share

        run_gemm_share(argv[1:])
        return
    if argv and argv[0] == "packing":
        from skyrl_tx.bench.packing import run_packing

        run_packing(argv[1:])
        return
    if argv and argv[0] == "data-parallel":
        from skyrl_tx.bench.data_parallel import run_data_parallel

        run_data_parallel(argv[1:])
        return
    if argv and argv[0] == "weight-sync":
        from skyrl_tx.bench.weight_sync import run_weight_sync

        run_weight_sync(argv[1:])
        return
    if argv and argv[0] == "latency":
        from skyrl_tx.bench.latency import run_latency

        run_latency(argv[1:])
        return
    if argv and argv[0] == "snapshots":
        from skyrl_tx.bench.snapshots import run_snapshots

        run_snapshots(argv[1:])
        return
    if argv and argv[0] == "saves":
        from skyrl_tx.bench.saves import run_saves

        run_saves(argv[1:])
        return
    if argv and argv[0] == "sampling-load":
        from skyrl_tx.bench.sampling_load import run_sampling_load

        run_sampling_load(argv[1:])
        return
    if argv and argv[0] == "idle-sessions":
        from skyrl_tx.bench.idle_sessions import run_idle_sessions

        run_idle_sessions(argv[1:])
        return
    if argv and argv[0] == "compute":
        argv = argv[1:]
    run_compute(argv)


if __name__ == "__main__":
    main()
