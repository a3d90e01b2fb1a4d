"""`python -m skyrl_tx.bench prefix-cache`: multi-turn rollouts with the sampler's prefix cache on vs off.

Each conversation re-sends everything so far plus a new user turn, as an RL rollout over several turns does; both
backends (same weights, same process) sample the same turns greedily, so they do the same decode work and differ
only in what the prefill recomputes. Reported: wall time off / on (the speedup), the prompt tokens served from the
cache, and that both produced the same tokens."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from skyrl_tx.bench.configs import CONFIGS, default_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench prefix-cache",
                                description="Multi-turn sampling with the prefix cache on vs off.")
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", choices=sorted(CONFIGS), help="model (default: cpu, or qwen3-0.6b on a GPU)")
    p.add_argument("--conversations", type=int, default=8, help="rollouts sampled together each turn")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=256, help="shared prompt every conversation starts with")
    p.add_argument("--user-tokens", type=int, default=32, help="new tokens each user turn adds")
    p.add_argument("--reply-tokens", type=int, default=32, help="tokens sampled per turn")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per side (best reported)")
    return p


def _backend(cfg: Any, device: str, caching: bool, rows: int, length: int) -> Any:
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.bench.configs import model_dir
    from skyrl_tx.config import BackendSettings

    # Twice the rows the rollouts need at once, so finished turns can stay cached while the next ones run.
    settings = BackendSettings.from_dict(dict(dtype=cfg.dtype, device=device, max_sampling_sequences=2 * rows,
                                              max_sampling_length=length, prefix_caching=caching))
    return NativeBackend(model_dir(cfg), settings)


def _rollouts(backend: Any, args: argparse.Namespace, vocab: int, seed: int) -> tuple[float, int, list[list[int]]]:
    """Wall seconds, prompt tokens served from the cache, and every reply's tokens."""
    from skyrl_tx.types import SampleRequest, SamplingParams

    # The same conversations on both sides; a new seed per repetition, so no repetition hits another's entries.
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(args.system_tokens)]
    history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, stop=[])
    hits, replies = 0, []
    start = time.perf_counter()
    for _ in range(args.turns):
        for h in history:
            h.extend(rng.randrange(10, vocab) for _ in range(args.user_tokens))
        results = backend.sample([SampleRequest(list(h), params) for h in history])
        for h, result in zip(history, results):
            tokens = list(result.sequences[0].tokens)
            h.extend(tokens)
            replies.append(tokens)
            hits += result.prompt_cache_hit_tokens
    return time.perf_counter() - start, hits, replies


def run_prefix_cache(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    cfg = CONFIGS[args.config or default_config(args.device)]
    from skyrl_tx.bench.configs import model_dir

    vocab = json.loads((model_dir(cfg) / "config.json").read_text())["vocab_size"]
    length = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens) + 8
    report: dict[str, Any] = {"config": cfg.name, "device": args.device, **{k: v for k, v in vars(args).items()
                                                                          if k not in ("config", "device")}}
    sides = {}
    for caching in (False, True):
        backend = _backend(cfg, args.device, caching, args.conversations, length)
        _rollouts(backend, args, vocab, seed=-1)  # warm-up (allocations, the first decode steps)
        runs = [_rollouts(backend, args, vocab, seed=rep) for rep in range(args.reps)]
        sides["on" if caching else "off"] = (min(r[0] for r in runs), runs[0][1], runs[0][2])
        del backend
    prompt_tokens = sum(args.system_tokens + t * (args.user_tokens + args.reply_tokens) + args.user_tokens
                        for t in range(args.turns)) * args.conversations
    report.update(seconds_off=sides["off"][0], seconds_on=sides["on"][0], speedup=sides["off"][0] / sides["on"][0],
                  prompt_tokens=prompt_tokens, cache_hit_tokens=sides["on"][1],
                  same_tokens=sides["off"][2] == sides["on"][2])
    print(f"{cfg.name} on {args.device}: {args.conversations} conversations x {args.turns} turns; prefix cache off "
          f"{report['seconds_off']:.2f} s, on {report['seconds_on']:.2f} s: {report['speedup']:.2f}x; "
          f"{report['cache_hit_tokens']} of {prompt_tokens} prompt tokens from the cache; same tokens: "
          f"{report['same_tokens']}", file=sys.stderr)
    print(json.dumps(report))
    return report
