"""A forward_backward batch is all-or-nothing: a micro-batch failing at run time leaves every model's gradients as
they were, so the engine's one-by-one rerun adds no row twice (the failure is injected by the test build's hook)."""

from __future__ import annotations

import pytest
import torch
from train_reference import (
    ROBUST_ADAM,
    assert_dicts_close,
    assert_dicts_equal,
    create_lora_with_nonzero_b,
    make_datums,
    our_logprobs,
    random_sequences,
)

from engine_rows import add, create, future, results

from skyrl_tx._ext import load_extension
from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.config import BackendSettings
from skyrl_tx.db import migrate
from skyrl_tx.db.session import make_engine, make_session_factory
from skyrl_tx.engine.checkpointing import Checkpointer
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.errors import ResourceExhaustedError
from skyrl_tx.types import TrainRequest

_C = load_extension()
pytestmark = pytest.mark.skipif(not hasattr(_C, "_testing_fail_micro_batch"),
                                reason="needs a test build of _C (SKYRL_TX_BUILD_TESTS=ON, as tests/run_all.sh builds)")

MODELS = ("a", "b", "full")
# Rows of 10, 9, 6 and 5 tokens (a and b) pack into two micro-batches of the shared base under a 20-token budget,
# [10, 9] and [6, 5]; the full model's 8-token row is a third. Checked by the test itself.
LENGTHS = {"a": [10, 6], "b": [9, 5], "full": [8]}
MICRO_BATCH_TOKENS = 20


def make_backend(tiny_model_dir, gradient_checkpointing: bool) -> NativeBackend:
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(
        max_lora_adapters=2, max_lora_rank=4, max_full_models=1, train_micro_batch_tokens=MICRO_BATCH_TOKENS,
        gradient_checkpointing=gradient_checkpointing))
    create_lora_with_nonzero_b(backend, "a", rank=4, alpha=8.0, seed=1, b_seed=2)
    create_lora_with_nonzero_b(backend, "b", rank=4, alpha=8.0, seed=3, b_seed=4)
    backend.create_model("full", lora_rank=0)
    return backend


def batch(backend: NativeBackend, seed: int) -> list[TrainRequest]:
    """cross_entropy for a and full, ppo for b, one request per model."""
    vocab = backend.decoder_config.vocab_size
    requests = []
    for i, model_id in enumerate(MODELS):
        seqs = random_sequences(vocab, LENGTHS[model_id], seed + 10 * i)
        loss_fn = "ppo" if model_id == "b" else "cross_entropy"
        requests.append(TrainRequest(model_id, make_datums(loss_fn, seqs, our_logprobs(backend, model_id, seqs),
                                                           seed + 10 * i + 1), loss_fn))
    return requests


def grads(backend: NativeBackend) -> dict[str, torch.Tensor]:
    return {f"{m}/{name}": g for m in MODELS for name, g in backend.trainable_grads(m).items()}


def state(backend: NativeBackend) -> dict[str, torch.Tensor]:
    return {f"{m}/{name}": w for m in MODELS for name, w in backend.trainable_state(m).items()}


@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_failed_micro_batch_changes_no_gradient(tiny_model_dir, gradient_checkpointing: bool) -> None:
    live, ref = make_backend(tiny_model_dir, gradient_checkpointing), make_backend(tiny_model_dir,
                                                                                   gradient_checkpointing)
    first, failed, last = batch(live, 0), batch(live, 100), batch(live, 200)

    # The premise: the failed batch runs exactly 3 micro-batches (forward plans them like forward_backward).
    _C._testing_fail_micro_batch(3)
    live.forward(failed)
    _C._testing_fail_micro_batch(-1)
    _C._testing_fail_micro_batch(2)
    with pytest.raises(ResourceExhaustedError, match="injected failure"):
        live.forward(failed)

    for backend in (live, ref):
        backend.forward_backward(first)  # gradients pending before the failure
    before = grads(live)
    assert max(g.abs().max().item() for g in before.values()) > 1e-3

    _C._testing_fail_micro_batch(1)  # micro-batch 2 of 3 fails after its backward ran
    with pytest.raises(ResourceExhaustedError, match="injected failure"):
        live.forward_backward(failed)
    assert_dicts_equal(grads(live), before, "accumulated gradients after the failed batch")

    for backend in (live, ref):
        backend.forward_backward(last)
    assert_dicts_equal(grads(live), grads(ref), "gradients of a run that never saw the failed batch")
    for backend in (live, ref):
        for model_id in MODELS:
            backend.optim_step(model_id, ROBUST_ADAM)
    assert_dicts_close(state(live), state(ref), 1e-7, "weights of a run that never saw the failed batch")


# ---- through the engine: its fallback reruns a failed batch's requests one by one -------------------------------
def engine_loop(path, tiny_model_dir) -> EngineLoop:
    """An EngineLoop on the real core (as tests/engine's fixture) whose 4-token rows pack 2 per micro-batch."""
    path.mkdir()
    url = f"sqlite:///{path / 'engine.db'}"
    migrate.upgrade(url)
    model_dir = tiny_model_dir("tiny-qwen3")
    backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=2, train_micro_batch_tokens=8))
    sessions = make_session_factory(make_engine(url))
    checkpointer = Checkpointer(backend, CheckpointStore(str(path / "checkpoints")), sessions, model_dir)
    return EngineLoop(backend, sessions, checkpointer, session_timeout_s=60)


def datum(first: int) -> dict:
    tokens = list(range(first, first + 5))
    return {"input_tokens": tokens[:-1], "loss_fn_inputs": {
        "target_tokens": {"dtype": "int64", "shape": [4], "values": tokens[1:]},
        "weights": {"dtype": "float32", "shape": [4], "values": [1.0, 1.0, 1.0, 1.0]}}}


def test_engine_rerun_after_a_failed_micro_batch_applies_each_row_once(tmp_path, tiny_model_dir) -> None:
    """Two models' forward_backward requests form one batch of 3 micro-batches (5 rows, 2 per micro-batch); the
    second fails, the engine reruns each request alone, and the gradients are those of an undisturbed run."""
    models = {"s:a:0": [datum(5), datum(40), datum(80)], "s:b:0": [datum(120), datum(160)]}
    loops = {"failed": engine_loop(tmp_path / "failed", tiny_model_dir),
             "undisturbed": engine_loop(tmp_path / "undisturbed", tiny_model_dir)}
    for name, loop in loops.items():
        for i, (model_id, data) in enumerate(models.items()):
            create(loop, f"s{i}", model_id)
        add(loop, *(future(f"{model_id}:1", "forward_backward", {"model_id": model_id, "loss_fn": "cross_entropy",
                                                                  "loss_fn_config": {}, "data": data}, model_id, 1)
                    for model_id, data in models.items()))
        if name == "failed":
            _C._testing_fail_micro_batch(1)
        loop.step()
        assert _C._testing_fail_micro_batch(-1) == -1, "the armed failure must have fired (and been consumed)"
        assert {f.status for fid, f in results(loop).items() if fid.endswith(":1")} == {"completed"}, name
    for model_id in models:
        got, want = (loops[name].backend.trainable_grads(model_id) for name in ("failed", "undisturbed"))
        assert max(g.abs().max().item() for g in want.values()) > 1e-3
        # The rerun packs rows differently from the batch (one request at a time): equal up to summation order.
        assert_dicts_close(got, want, 1e-5, f"{model_id} gradients after the engine's rerun")
