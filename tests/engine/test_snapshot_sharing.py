"""Full fine-tuning snapshots share the tensors that did not change between versions: in the backend's frozen
copies (one storage, counted once by frozen_bytes) and in the spill files (written once, read back by every
snapshot that refers to them); each version still samples exactly what its own weights sample."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from train_reference import ROBUST_ADAM, make_datums, our_logprobs, random_sequences

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.engine.loop import EngineLoop
from skyrl_tx.types import SampleRequest, SamplingParams, TrainRequest

from engine_rows import DATUM, FULL_MODEL, SEEDED_SAMPLE, add, full_model_loop, future, results

PROMPT = [5, 17, 3, 25, 41, 9]
PARAMS = SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[])


def _step(backend: NativeBackend, model_id: str, seed: int) -> None:
    seqs = random_sequences(backend.decoder_config.vocab_size, [7, 5], seed)
    backend.forward_backward([TrainRequest(model_id, make_datums("cross_entropy", seqs,
                                                                 our_logprobs(backend, model_id, seqs), seed),
                                           "cross_entropy")])
    backend.optim_step(model_id, ROBUST_ADAM)


def _samples(backend: NativeBackend, ids: list[str]) -> list[tuple[list[int], list[float]]]:
    out = backend.sample([SampleRequest(PROMPT, PARAMS, num_samples=2, weights_id=i) for i in ids])
    return [[(list(s.tokens), [float(x) for x in s.logprobs]) for s in r.sequences] for r in out]


def _pointers(backend: NativeBackend, snapshot_id: str) -> dict[str, int]:
    # On the CPU the frozen model's weights come back as its own tensors (no copy): their storage is the frozen one.
    return {k: v.data_ptr() for k, v in backend.frozen_model_weights(snapshot_id).items()}


def test_snapshots_without_a_step_share_everything_and_a_step_unshares_what_it_wrote(tiny_model_dir) -> None:
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=1))
    backend.create_model("full", lora_rank=0)
    versions = {"v0": backend.trainable_state("full", model_dtype=True)}
    whole = sum(t.nbytes for t in versions["v0"].values())
    assert backend.snapshot_cost("full") == whole  # nothing frozen yet: a whole copy
    backend.snapshot("full", "v0")
    assert backend.snapshot_cost("full") == 0  # no optim_step since: all of it is shared
    backend.snapshot("full", "v0-again")
    assert backend.frozen_bytes() == whole
    assert _pointers(backend, "v0") == _pointers(backend, "v0-again")

    _step(backend, "full", seed=1)
    versions["v1"] = backend.trainable_state("full", model_dtype=True)
    assert backend.snapshot_cost("full") == whole  # the step wrote every tensor of this dense model
    backend.snapshot("full", "v1")
    assert backend.frozen_bytes() == 2 * whole
    v0, v1 = _pointers(backend, "v0"), _pointers(backend, "v1")
    assert not set(v0.values()) & set(v1.values())

    backend.remove_snapshot("v0")  # its storage lives on in v0-again, which shares it
    assert backend.frozen_bytes() == 2 * whole
    for name, weights in versions.items():  # a frozen model of each version's weights, loaded the ordinary way
        backend.load_frozen_model(f"ref-{name}", {k: v.clone() for k, v in weights.items()})
    got = _samples(backend, ["v0-again", "v1", "ref-v0", "ref-v1"])
    assert got[0] == got[2] and got[1] == got[3]  # each version samples its own weights
    assert got[0] != got[1]


def test_tensors_a_step_does_not_write_stay_shared(tiny_model_dir) -> None:
    """DeepSeek-V3's router score bias is a buffer: saved with the model, never stepped."""
    backend = NativeBackend(tiny_model_dir("tiny-deepseek-v3"), BackendSettings(max_lora_adapters=1))
    backend.create_model("full", lora_rank=0)
    backend.snapshot("full", "v0")
    before = backend.trainable_state("full", model_dtype=True)
    _step(backend, "full", seed=2)
    backend.snapshot("full", "v1")
    after = backend.trainable_state("full", model_dtype=True)
    v0, v1 = _pointers(backend, "v0"), _pointers(backend, "v1")
    frozen = {k for k in before if k.endswith("e_score_correction_bias")}
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert all(v0[k] == v1[k] for k in frozen)
    trained = {k for k in before if not torch.equal(before[k], after[k])}
    assert trained and all(v0[k] != v1[k] for k in trained)
    for name, weights in (("v0", before), ("v1", after)):
        backend.load_frozen_model(f"ref-{name}", {k: v.clone() for k, v in weights.items()})
    got = _samples(backend, ["v0", "v1", "ref-v0", "ref-v1"])
    assert got[0] == got[2] and got[1] == got[3]


# ---- through the engine: the budget counts shared bytes once, and spill files are shared too ---------------------
MODEL, SAMPLE = FULL_MODEL, SEEDED_SAMPLE


@pytest.fixture()
def loop(tmp_path, tiny_model_dir) -> Iterator[EngineLoop]:
    with full_model_loop(tmp_path, tiny_model_dir("tiny-qwen3")) as loop:
        yield loop


def _run(loop: EngineLoop, *rows) -> dict:
    add(loop, *rows)
    ids = [r.id for r in rows]
    for _ in range(2000):
        done = results(loop)
        if all(done[i].status in ("completed", "failed") for i in ids):
            assert all(done[i].status == "completed" for i in ids), [done[i].error for i in ids]
            memory = loop.checkpointer.snapshot_memory
            assert memory.resident_bytes <= memory.budget
            return {i: done[i] for i in ids}
        loop.step()
    raise AssertionError("requests did not finish")


def _sample(loop: EngineLoop, fid: str, weights_id: str) -> list:
    done = _run(loop, future(fid, "sample", {**SAMPLE, "weights_id": weights_id}))[fid]
    return [(s["tokens"], s["logprobs"]) for s in done.result["sequences"]]


def _snapshot(loop: EngineLoop, seq: int, name: str) -> int:
    _run(loop, future(f"{MODEL}:{seq}", "save_weights_for_sampler", {"model_id": MODEL, "sampling_session_id": name},
                      MODEL, seq))
    return seq + 1


def test_the_budget_and_the_spill_files_hold_shared_tensors_once(loop: EngineLoop) -> None:
    memory = loop.checkpointer.snapshot_memory
    whole = memory.size_of(loop.backend.trainable_state(MODEL))
    memory.budget = int(1.5 * whole)  # one frozen copy's room
    seq = _snapshot(loop, 1, "s:sample:a")
    written = memory.spilled_bytes
    assert written == whole
    seq = _snapshot(loop, seq, "s:sample:b")  # no optim_step between: the same weights
    assert memory.spilled_bytes == written  # b's spill wrote nothing: it refers to a's file
    assert loop.backend.has_snapshot("s:sample:a") and loop.backend.has_snapshot("s:sample:b")  # both fit: shared
    before = {n: _sample(loop, f"before:{n}", n) for n in ("s:sample:a", "s:sample:b")}
    assert before["s:sample:a"] == before["s:sample:b"]

    fb = {"model_id": MODEL, "loss_fn": "cross_entropy", "loss_fn_config": {}, "data": [DATUM]}
    _run(loop, future(f"{MODEL}:{seq}", "forward_backward", fb, MODEL, seq),
         future(f"{MODEL}:{seq + 1}", "optim_step", {"model_id": MODEL, "adam_params": {"learning_rate": 0.05}},
                MODEL, seq + 1))
    seq = _snapshot(loop, seq + 2, "s:sample:c")  # new weights: a and b leave memory to make room
    assert memory.spilled_bytes == written + whole
    assert not loop.backend.has_snapshot("s:sample:a") and not loop.backend.has_snapshot("s:sample:b")
    before["s:sample:c"] = _sample(loop, "before:c", "s:sample:c")
    assert before["s:sample:c"] != before["s:sample:a"]

    memory.release("s:sample:a")  # b still refers to the file a's spill wrote
    assert _sample(loop, "after:b", "s:sample:b") == before["s:sample:b"]  # loaded back from that file
    assert _sample(loop, "after:c", "s:sample:c") == before["s:sample:c"]
