"""`python -m skyrl_tx.bench snapshots`: host memory and time per full fine-tuning snapshot at a real model's widths.

A bf16 full fine-tune of Qwen3-0.6B at its published widths (vocab 151,936, hidden 1,024; depth cut to --layers,
models/published_checkpoint.py) on the native backend in this process. Per sampler snapshot (engine/
snapshot_memory.py) and per recovery snapshot (engine/recovery_state.py) it reports the time the engine thread
spends (what every other user waits for), the time off it (spill writes, recovery copies), the growth of this
process's resident memory (RSS; on the CPU the frozen copies are host memory too), the frozen bytes the backend
adds and the spill bytes written. Paths:
- sampler, "full copy": a snapshot as it was before sharing (a float32 host copy of every tensor, every tensor
  spilled, the frozen copy cloned whole: the previous copy is released first, so the backend has nothing to share);
- sampler, "shared": the engine's path now, right after an optim_step and again with no step between;
- recovery, "on the loop": trainable_state + optimizer_state on the engine thread (before, and still so for models
  split over ranks); "off the loop": state_views on the engine thread, the host copies on the copier thread.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.engine.recovery_state import host_copies
from skyrl_tx.engine.snapshot_memory import SnapshotMemory
from skyrl_tx.types import AdamParams, Datum, SampleRequest, SamplingParams, TrainRequest

MODEL = "full"


def _rss() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench snapshots",
                                description="Host memory and time per full fine-tuning snapshot (bf16, real widths).")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="a published family (plan/published.py)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers kept (widths stay as published)")
    p.add_argument("--preset", default=None, help="a tiny preset instead (the smoke test)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


def _train_step(backend: NativeBackend, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, backend.decoder_config.vocab_size, (33,), generator=g).tolist()
    datum = Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(32)})
    backend.forward_backward([TrainRequest(MODEL, [datum], "cross_entropy")])
    backend.optim_step(MODEL, AdamParams(learning_rate=1e-4))


def _measure(fn: Any) -> tuple[float, int, Any]:
    gc.collect()
    rss = _rss()
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, _rss() - rss, out


def run_snapshots(argv: list[str]) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.preset:
        from skyrl_tx.models.checkpoint import resolve_model_path

        model_dir = resolve_model_path(args.preset)
    else:
        from skyrl_tx.models.published_checkpoint import reduced_model_dir

        model_dir = reduced_model_dir(args.model, num_layers=args.layers)
    backend = NativeBackend(model_dir, BackendSettings(dtype="bfloat16", max_lora_adapters=1, max_full_models=1))
    backend.create_model(MODEL, lora_rank=0)
    import torch

    memory = SnapshotMemory(backend, 1 << 50, torch.bfloat16)
    rows: list[dict[str, Any]] = []

    def sampler(label: str, snapshot_id: str, full_copy: bool) -> None:
        frozen, spilled = backend.frozen_bytes(), memory.spilled_bytes
        # The engine thread's part: Checkpointer.snapshot (before sharing it took a float32 host copy of all).
        engine_s, rss, _ = _measure(lambda: memory.freeze(
            MODEL, snapshot_id, backend.trainable_state(MODEL) if full_copy else None))
        started = time.perf_counter()
        for spill in memory._spilled.values():
            spill.failed()  # waits for the writes
        rows.append({"kind": "sampler", "path": label, "engine_thread_s": round(engine_s, 3),
                     "off_thread_s": round(time.perf_counter() - started, 3), "rss_delta_mb": round(rss / 2**20, 1),
                     "frozen_added_mb": round((backend.frozen_bytes() - frozen) / 2**20, 1),
                     "spilled_mb": round((memory.spilled_bytes - spilled) / 2**20, 1)})

    def recovery(label: str, on_loop: bool) -> None:
        if on_loop:
            engine_s, rss, held = _measure(lambda: (backend.trainable_state(MODEL), backend.optimizer_state(MODEL)))
            off_s = 0.0
        else:
            engine_s, _, views = _measure(lambda: backend.state_views(MODEL))
            gc.collect()
            base = _rss()
            started = time.perf_counter()
            held = host_copies(*views)  # what the copier thread runs
            off_s, rss = time.perf_counter() - started, _rss() - base
        rows.append({"kind": "recovery", "path": label, "engine_thread_s": round(engine_s, 3),
                     "off_thread_s": round(off_s, 3), "rss_delta_mb": round(rss / 2**20, 1),
                     "frozen_added_mb": 0.0, "spilled_mb": 0.0})
        del held

    _train_step(backend, 1)
    sampler("full copy (before), after a step", "old-1", full_copy=True)
    memory.release("old-1")  # nothing left to share: the backend clones every tensor, as it did before sharing
    sampler("full copy (before), no step between", "old-2", full_copy=True)
    memory.release("old-2")
    _train_step(backend, 2)
    sampler("shared (now), after a step", "new-1", full_copy=False)
    sampler("shared (now), no step between", "new-2", full_copy=False)
    recovery("on the loop (before)", on_loop=True)
    recovery("off the loop (now)", on_loop=False)
    # Each version samples its own weights: the two snapshots without a step between give the same tokens.
    params = SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    outs = backend.sample([SampleRequest([5, 6, 7], params, weights_id=i) for i in ("new-1", "new-2")])
    same = list(outs[0].sequences[0].tokens) == list(outs[1].sequences[0].tokens)
    memory.close()
    params_count = sum(t.numel() for t in backend.trainable_state(MODEL, model_dtype=True).values())
    report = {"model": str(model_dir.name), "parameters": params_count, "dtype": "bfloat16", "rows": rows,
              "shared_versions_sample_alike": same}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['model']}: {params_count / 1e6:.1f}M parameters, bf16 full fine-tune, CPU")
        print(f"{'kind':9} {'path':38} {'engine s':>9} {'off s':>7} {'RSS +MB':>8} {'frozen +MB':>10} {'spill MB':>9}")
        for r in rows:
            print(f"{r['kind']:9} {r['path']:38} {r['engine_thread_s']:9.3f} {r['off_thread_s']:7.3f} "
                  f"{r['rss_delta_mb']:8.1f} {r['frozen_added_mb']:10.1f} {r['spilled_mb']:9.1f}")
    sys.stdout.flush()
    return report
