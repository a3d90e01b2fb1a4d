"""A spill file whose write failed is never what a later snapshot of the same weights refers to: that snapshot writes
its own file, so one failed write (a full disk, for a moment) does not make every later version unloadable."""

from __future__ import annotations

import torch
from train_reference import ROBUST_ADAM, make_datums, our_logprobs, random_sequences

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.engine.snapshot_memory import SnapshotMemory
from skyrl_tx.types import TrainRequest


def test_a_snapshot_after_a_failed_spill_write_writes_its_own_file(tmp_path, tiny_model_dir) -> None:
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=1))
    backend.create_model("full", lora_rank=0)
    v0 = backend.trainable_state("full", model_dtype=True)
    whole = sum(t.nbytes for t in v0.values())
    memory = SnapshotMemory(backend, whole, torch.float32)  # room for one frozen copy
    try:
        memory._dir = tmp_path / "missing"  # a's write fails: its directory does not exist
        memory.freeze("full", "a")
        assert memory._spilled["a"].failed()  # waits for the write
        memory._dir = tmp_path  # writes succeed from now on
        memory.freeze("full", "b")  # no step between: the same weights as a, shared in memory
        assert backend.has_snapshot("a") and backend.has_snapshot("b")

        seqs = random_sequences(backend.decoder_config.vocab_size, [7, 5], 1)
        backend.forward_backward([TrainRequest("full", make_datums("cross_entropy", seqs,
                                                                   our_logprobs(backend, "full", seqs), 1),
                                               "cross_entropy")])
        backend.optim_step("full", ROBUST_ADAM)
        memory.release("a")
        memory.freeze("full", "c")  # new weights: b must leave memory for c, so b needs a file it can load from
        assert backend.has_snapshot("c") and not backend.has_snapshot("b")
        memory.release("c")
        assert memory.ensure("b")  # loaded back from b's own file
        got = backend.frozen_model_weights("b")
        assert all(torch.equal(got[k], v) for k, v in v0.items())
    finally:
        memory.close()
