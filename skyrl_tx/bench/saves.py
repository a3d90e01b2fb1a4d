"""`python -m skyrl_tx.bench saves`: another user's sampling rate while a ~100 MB full fine-tuning checkpoint is saved.

An engine loop in this process (SQLite, the native backend) serves user "b"'s 16 samples, alone and again while user
"a" saves a checkpoint whose upload takes as long as at --upload-mb-s (a remote bucket; 0: local disk speed).
Rounds alternate the two, so a busy machine slows both alike; the ratio is best alone / best with the save (other
processes only add time). Mode `background` is the engine's own path (the save written on its worker thread,
engine/background_saves.py); `on-loop` writes the same checkpoint on the engine thread between two steps, as saves
ran before, for comparison. This figure used to be a test's bound; tests assert the schedule, never a time."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import select

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.config import BackendSettings
from skyrl_tx.db import migrate
from skyrl_tx.db.models import FutureRecord, ModelRecord, SessionRecord, request_hash
from skyrl_tx.db.session import make_engine, make_session_factory
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.models.tiny_presets import generate_model

SAMPLES = 16
STEP_LIMIT = 100_000  # bounds every stepping loop: a request that never finishes fails the run instead of hanging
MODES = ("background", "on-loop")
# tiny-qwen3 widened to ~29M parameters: ~118 MB of float32 weights.
SIZES = {"100mb": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=8, head_dim=64),
         "tiny": {}}  # the preset as it is (the smoke test)


class UploadStore(CheckpointStore):
    """A local store whose publish takes at least as long as an upload at `bytes_per_s` would."""

    def __init__(self, base_url: str, bytes_per_s: float):
        super().__init__(base_url)
        self.bytes_per_s = bytes_per_s

    def publish(self, *args: Any, **kwargs: Any) -> int:
        started = time.perf_counter()
        size = super().publish(*args, **kwargs)
        if self.bytes_per_s > 0:
            time.sleep(max(0.0, size / self.bytes_per_s - (time.perf_counter() - started)))
        return size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m skyrl_tx.bench saves",
                                description="Another user's sampling rate while a checkpoint is saved.")
    p.add_argument("--size", choices=sorted(SIZES), default="100mb", help="the saved model (default 100mb)")
    p.add_argument("--upload-mb-s", type=float, default=100.0, help="upload bandwidth to emulate (0: none)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per mode, each one alone + one with a save")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per sample")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    return p


class _Engine:
    """An engine loop on a fresh SQLite database, with one full fine-tuning model "a" to save."""

    def __init__(self, root: Path, model_dir: Path, bytes_per_s: float):
        url = f"sqlite:///{root / 'engine.db'}"
        migrate.upgrade(url)
        backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=1))
        sessions = make_session_factory(make_engine(url))
        checkpointer = Checkpointer(backend, UploadStore(str(root / "checkpoints"), bytes_per_s), sessions, model_dir)
        self.loop = EngineLoop(backend, sessions, checkpointer, session_timeout_s=24 * 3600)
        self.add(SessionRecord(id="a", last_heartbeat_at=datetime.now(timezone.utc)))
        self.add(ModelRecord(id="a:train:0", session_id="a", base_model=model_dir.name, lora_rank=0),
                 self.future("a:create", "create_model", {"model_id": "a:train:0", "lora_rank": 0, "seed": 1,
                                                          "train_attn": True, "train_mlp": True,
                                                          "train_unembed": True}))
        self.run_until(["a:create"])

    def add(self, *rows: Any) -> None:
        with self.loop.sessions.begin() as db:
            db.add_all(rows)

    @staticmethod
    def future(fid: str, kind: str, body: dict[str, Any], model_id: str | None = None,
               seq_id: int | None = None) -> FutureRecord:
        return FutureRecord(id=fid, request_type=kind, request=body, request_hash=request_hash(body),
                            model_id=model_id, seq_id=seq_id)

    def statuses(self, ids: list[str]) -> dict[str, str]:
        with self.loop.sessions() as db:
            return dict(db.execute(select(FutureRecord.id, FutureRecord.status).where(FutureRecord.id.in_(ids))).all())

    def run_until(self, ids: list[str]) -> None:
        for _ in range(STEP_LIMIT):
            got = self.statuses(ids)
            if all(got.get(i) in ("completed", "failed") for i in ids):
                failed = [i for i in ids if got[i] == "failed"]
                if failed:
                    raise SystemExit(f"requests failed: {failed}")
                return
            self.loop.step()
        raise SystemExit(f"requests did not finish within {STEP_LIMIT} engine steps: {ids}")


def _sampling_seconds(engine: _Engine, tag: str, max_tokens: int, save: int | None, mode: str) -> float:
    """Wall seconds for user "b"'s SAMPLES samples to finish, with user "a" saving checkpoint number `save` (also
    the save's seq_id: a's only requests are saves) at the same moment."""
    rows = [engine.future(f"{tag}:{i}", "sample", {"prompt_tokens": [1, 2, 3, 4, 5, 6, 7, 8], "num_samples": 1,
                                                   "weights_id": "", "sampling_params": {
                                                       "max_tokens": max_tokens, "temperature": 1.0, "seed": i}})
            for i in range(SAMPLES)]
    request = {"model_id": "a:train:0", "path": str(TinkerPath("a:train:0", "weights", f"{mode}_{save}"))}
    if save is not None and mode == "background":
        rows.append(engine.future(f"a:{save}", "save_weights", request, "a:train:0", save))
    engine.add(*rows)
    ids = [f"{tag}:{i}" for i in range(SAMPLES)]
    started = time.perf_counter()
    if save is not None and mode == "on-loop":
        engine.loop.step()  # the samples join the batch; then the engine thread writes the whole checkpoint
        engine.loop.checkpointer.save(request)
    engine.run_until(ids)
    seconds = time.perf_counter() - started
    if save is not None and mode == "background":
        engine.run_until([f"a:{save}"])
    return seconds


def _measure(engine: _Engine, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    _sampling_seconds(engine, f"{mode}:warm", args.max_tokens, None, mode)  # first steps allocate the KV cache
    alone, with_save = [], []
    for r in range(1, args.rounds + 1):
        alone.append(_sampling_seconds(engine, f"{mode}:alone{r}", args.max_tokens, None, mode))
        with_save.append(_sampling_seconds(engine, f"{mode}:save{r}", args.max_tokens, r, mode))
    return {"alone_s": alone, "with_save_s": with_save, "ratio": min(alone) / min(with_save)}


def run_saves(argv: list[str]) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: choose from {', '.join(MODES)}")
    report: dict[str, Any] = {"size": args.size, "upload_mb_s": args.upload_mb_s, "rounds": args.rounds,
                              "samples": SAMPLES, "max_tokens": args.max_tokens, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="skyrl-tx-bench-saves-") as tmp:
        print(f"generating the {args.size} model ...", file=sys.stderr, flush=True)
        model_dir = generate_model("tiny-qwen3", Path(tmp) / f"tiny-qwen3-{args.size}", **SIZES[args.size])
        for mode in modes:
            engine = _Engine(Path(tmp) / mode, model_dir, args.upload_mb_s * 1e6)
            report["modes"][mode] = _measure(engine, mode, args)
            store = engine.loop.checkpointer.store
            last = TinkerPath("a:train:0", "weights", f"{mode}_{args.rounds}")
            report["checkpoint_mb"] = sum(store.files(store.location(last)).values()) / 1e6
            engine.loop.checkpointer.saves.close()
    for mode, r in report["modes"].items():
        print(f"{mode:>10}: other user's sampling at {r['ratio']:.2f} of its rate while a "
              f"{report['checkpoint_mb']:.0f} MB checkpoint is saved at {args.upload_mb_s:g} MB/s "
              f"(best of {args.rounds}: alone "
              f"{min(r['alone_s']):.2f} s, with the save {min(r['with_save_s']):.2f} s)", file=sys.stderr)
    print(json.dumps(report))
    return report
