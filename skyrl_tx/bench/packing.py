"""`python -m skyrl_tx.bench packing`: a training step (or, with --prefill, a sampling prefill) over sequences of
mixed lengths, packed back to back against right-padded rows (issue 22, part 2), in one process.

Real SFT and RL batches mix lengths: a few long sequences and many short ones. Padded rows spend the longest
row's length on every sequence; packed rows (train_packed_sequences, the default) lay the sequences back to back
with varlen attention, so the step's work follows the real tokens. Two backends over one checkpoint, one per layout,
run the same forward_backward + optim_step; each repetition times both, the order alternating, so the machine's
drift lands on both sides. Reported: real and padded token counts, each layout's median step, real tokens per second,
the packed / padded time ratio, and the two layouts' losses (they must agree: the layouts compute the same sums).
--prefill times a sample call instead: the sequences as prompts of one adapter, one greedy token each
(sample_packed_prefill against padded prefill rows, no prefix cache), checked by the sum of those tokens' logprobs."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any

import torch

from skyrl_tx.bench import workloads as wl
from skyrl_tx.bench.configs import CONFIGS, default_config
from skyrl_tx.bench.timing import timed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench packing",
                                description="Mixed-length training step: packed sequences against padded rows.")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--config", choices=sorted(CONFIGS), help="model (default: cpu, or qwen3-0.6b on GPU)")
    p.add_argument("--sequences", type=int, default=12, help="sequences per step (default 12)")
    p.add_argument("--min-len", type=int, help="shortest sequence (default: the config's train_seq_len / 8)")
    p.add_argument("--max-len", type=int, help="longest sequence (default: twice the config's train_seq_len)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per layout (median reported)")
    p.add_argument("--threads", type=int, help="torch threads (default: the engine's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and tokens")
    p.add_argument("--prefill", action="store_true",
                   help="time a sampling prefill of the sequences as prompts (one token each) instead of training")
    return p


def mixed_lengths(count: int, shortest: int, longest: int, seed: int) -> list[int]:
    """Log-uniform lengths in [shortest, longest] (many short sequences, a few long ones, as in SFT data), the
    longest always included so every run pads to the same width."""
    gen = torch.Generator().manual_seed(seed)
    logs = torch.rand(count - 1, generator=gen) * (math.log(longest) - math.log(shortest)) + math.log(shortest)
    return [longest] + [int(round(math.exp(v))) for v in logs.tolist()]


def _backend(path, cfg, device: str, packed: bool, lengths: list[int]):
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.config import BackendSettings

    rank = cfg.workload.lora_rank
    # One micro-batch (and one prefill) on both sides, the padded one the larger: only the layout differs.
    budget = len(lengths) * max(lengths)
    settings = BackendSettings(max_lora_adapters=1, max_lora_rank=rank, dtype=cfg.dtype, device=device,
                               max_sampling_sequences=len(lengths), max_sampling_length=max(lengths) + 2,
                               prefix_caching=False, max_resident_snapshots=1, train_micro_batch_tokens=budget,
                               train_packed_sequences=packed, sample_packed_prefill=packed)
    backend = NativeBackend(path, settings)
    backend.create_model("bench", lora_rank=rank, alpha=2.0 * rank, seed=1)
    shapes = {k: tuple(v.shape) for k, v in backend.adapter_state_dict("bench").items()}
    backend.set_adapter_weights("bench", wl.random_lora_factors(shapes, 1))
    return backend


def measure(cfg_name: str, device: str, lengths: list[int], reps: int, seed: int,
            prefill: bool = False) -> dict[str, Any]:
    from skyrl_tx.bench.configs import model_dir
    from skyrl_tx.types import AdamParams, Datum, SampleRequest, SamplingParams, TrainRequest

    cfg = CONFIGS[cfg_name]
    path = model_dir(cfg)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed + 1)
    rows = [torch.randint(0, vocab, (n + 1,), generator=gen) for n in lengths]
    request = TrainRequest("bench", [Datum(r[:-1], {"target_tokens": r[1:], "weights": torch.ones(r.numel() - 1)})
                                     for r in rows])
    prompts = [SampleRequest(r[:-1].tolist(), SamplingParams(max_tokens=1, temperature=0.0), weights_id="bench")
               for r in rows]
    real, padded = sum(lengths), len(lengths) * max(lengths)
    backends = {layout: _backend(path, cfg, device, layout == "packed", lengths) for layout in ("packed", "padded")}
    params = AdamParams(learning_rate=wl.LEARNING_RATE, beta1=wl.BETAS[0], beta2=wl.BETAS[1], eps=wl.EPS)
    losses: dict[str, float] = {}  # training: the loss sum; prefill: the sum of the first tokens' logprobs

    def step(layout: str) -> None:
        backend = backends[layout]
        if prefill:
            losses[layout] = sum(r.sequences[0].logprobs[0] for r in backend.sample(prompts))
        else:
            losses[layout] = backend.forward_backward([request])[0].metrics["loss:sum"]
            backend.optim_step("bench", params)
        if device != "cpu":
            torch.cuda.synchronize(torch.device(device))

    times: dict[str, list[float]] = {"packed": [], "padded": []}
    for layout in times:  # warm-up: each side's first run allocates
        step(layout)
    first_losses = dict(losses)
    for rep in range(reps):
        for layout in (("packed", "padded") if rep % 2 == 0 else ("padded", "packed")):
            times[layout].append(timed(lambda layout=layout: step(layout), 0, 1)[0])
    report: dict[str, Any] = {"config": cfg.name, "device": device, "reps": reps, "lengths": lengths,
                              "workload": "prefill" if prefill else "training", "real_tokens": real,
                              "padded_tokens": padded, "padding_fraction": 1 - real / padded,
                              "first_logprob_sum" if prefill else "first_loss_sum": first_losses}
    for layout, seconds in times.items():
        median = statistics.median(seconds)
        report[layout] = {"step_s": median, "real_tokens_per_s": real / median, "reps_s": seconds}
    report["packed_over_padded"] = report["packed"]["step_s"] / report["padded"]["step_s"]
    report["reps_packed_faster"] = sum(p < q for p, q in zip(times["packed"], times["padded"]))
    return report


def run_packing(argv: list[str]) -> dict[str, Any]:
    from skyrl_tx.engine.threads import choose_threads

    args = _parser().parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is visible to torch")
    cfg_name = args.config or default_config(args.device)
    seq_len = CONFIGS[cfg_name].workload.train_seq_len
    shortest, longest = args.min_len or max(1, seq_len // 8), args.max_len or 2 * seq_len
    if not 1 <= shortest <= longest or args.sequences < 2:
        raise SystemExit("need 1 <= --min-len <= --max-len and --sequences >= 2")
    threads = args.threads or choose_threads(args.device).intra_op or torch.get_num_threads()
    torch.set_num_threads(threads)
    lengths = mixed_lengths(args.sequences, shortest, longest, args.seed)
    report = measure(cfg_name, args.device, lengths, args.reps, args.seed, args.prefill)
    report["threads"] = threads
    p, q = report["packed"], report["padded"]
    print(f"{report['config']} on {args.device} ({threads} threads), {report['workload']}, {len(lengths)} "
          f"sequences of {shortest}.."
          f"{longest} tokens: {report['real_tokens']} real, {report['padded_tokens']} padded "
          f"({report['padding_fraction']:.0%} padding); median of {args.reps}:\n"
          f"  packed {p['step_s'] * 1e3:.1f} ms ({p['real_tokens_per_s']:.0f} tok/s), "
          f"padded {q['step_s'] * 1e3:.1f} ms ({q['real_tokens_per_s']:.0f} tok/s): "
          f"packed / padded = {report['packed_over_padded']:.3f}, faster in "
          f"{report['reps_packed_faster']} of {args.reps}", file=sys.stderr)
    print(json.dumps(report))
    return report
