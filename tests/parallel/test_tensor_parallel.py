"""Tensor parallelism on real processes (Gloo): each rank holds its shard of the attention heads, MLP columns,
vocabulary (embedding and lm_head) and KV cache, and the group ends with one process's results — forward,
forward_backward with two LoRA tenants (lm_head LoRA included), three clipped AdamW steps, the gathered weights,
gradients and moments, greedy and seeded sampling with prompt and top-k logprobs, and a checkpoint from one process
loaded into the split layout — on Qwen3 and Llama 3 presets, and with data parallelism beside it (DP=2 x TP=2)."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import pytest
from rank_reports import spawn_ranks
from split_parity import (TIMEOUT_S, assert_same_as_one_process, numpy_dict, one_process_reference,
                           run_split_ranks, split_backend)


def _odd_vocabulary_copy(source, dest):
    """tiny-qwen3 with its last vocabulary row dropped (2111 rows): the ranks' vocabulary parts are unequal (1056 and
    1055), as they are for any vocabulary the rank count does not divide."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["vocab_size"] -= 1
    (dest / "config.json").write_text(json.dumps(config))
    weights = load_file(str(dest / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name] = weights[name][:-1].contiguous()
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama3", "tiny-qwen3-moe", "tiny-qwen3-moe-ep2",
                                    "tiny-qwen3-moe-ep2-grouped", "tiny-deepseek-v3-ep2", "tiny-qwen3.5",
                                    "tiny-qwen3.5-moe-ep2", "odd-vocabulary"])
def test_tensor_parallel_equals_one_process(tiny_model_dir, tmp_path, preset: str) -> None:
    """tiny-qwen3-moe: experts whole on every rank; -ep2: expert_parallel_size 2, 4 of the 8 experts on each rank
    (-grouped: run as grouped GEMMs; the one process runs them one by one).
    tiny-deepseek-v3: MLA split by heads (its latent whole on every rank, and cached whole), with experts split.
    tiny-qwen3.5: Gated DeltaNet split by heads (q, k and v each), its conv and recurrent states too."""
    if preset == "odd-vocabulary":
        model_dir = str(_odd_vocabulary_copy(tiny_model_dir("tiny-qwen3"), tmp_path / "tiny-qwen3-odd-vocabulary"))
    else:
        model_dir = str(tiny_model_dir(preset.removesuffix("-grouped").removesuffix("-ep2")))
    single = one_process_reference(model_dir)
    ranks = run_split_ranks(model_dir, 2, 2, checkpoint=single["initial"]["b"],
                            experts="tp" + preset.partition("-ep2")[2] if "-ep2" in preset else "")
    for rank, got in ranks.items():
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        assert_same_as_one_process(got, single, f"{preset} tp2 rank {rank}")
        # One process's checkpoint (b before training) loaded over the trained split adapter: one process's logprobs.
        for o, e in zip(got["loaded_logprobs"], single["initial_logprobs"], strict=True):
            np.testing.assert_allclose(o, e, atol=1e-5, err_msg=f"{preset} rank {rank}: a loaded checkpoint")


def test_data_parallel_by_tensor_parallel_equals_one_process(tiny_model_dir) -> None:
    """DP=2 x TP=2: rows split between two replicas of two ranks each."""
    model_dir = str(tiny_model_dir("tiny-qwen3"))
    single = one_process_reference(model_dir)
    ranks = run_split_ranks(model_dir, 4, 2)
    for rank, got in ranks.items():
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        assert_same_as_one_process(got, single, f"dp2xtp2 rank {rank}")


def _refusal_main(model_dir: str, rank: int, world: int, port: int, out: Any) -> None:
    from skyrl_tx.errors import InvalidArgumentError

    try:
        split_backend(model_dir, rank, world, world, port)
        out.put((rank, "accepted"))
    except InvalidArgumentError as exc:
        out.put((rank, exc.message))
    except Exception:  # noqa: BLE001
        out.put((rank, traceback.format_exc()))


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_on_every_rank(tiny_model_dir) -> None:
    """tiny-qwen3 has 4 attention heads and 2 KV heads: 3 ranks stop at load, naming the sizes and what to choose."""
    model_dir = str(tiny_model_dir("tiny-qwen3"))
    reports = spawn_ranks(_refusal_main, 3, lambda r, port, out: (model_dir, r, 3, port, out), 120, "tp3 refusal")
    for rank, message in reports.items():
        assert "tensor_parallel_size 3 must divide the model's attention heads (4), KV heads (2)" in message, \
            (rank, message)
        assert "choose a divisor of 2" in message, (rank, message)


def _dimuon_main(model_dir: str, rank: int, world: int, port: int, out: Any) -> None:
    """A Dimuon LoRA model (lm_head included) through 3 clipped steps; its weights and momentum, whole."""
    try:
        import torch
        from train_reference import make_datums, our_logprobs, random_sequences

        from skyrl_tx.types import DimuonParams, TrainRequest

        backend = split_backend(model_dir, rank, world, world, port)
        vocab = backend.decoder_config.vocab_size
        backend.create_model("d", lora_rank=4, alpha=8.0, seed=5, optimizer="dimuon")
        gen = torch.Generator().manual_seed(6)
        state = backend.trainable_state("d")
        backend.set_trainable_state("d", {k: torch.randn(v.shape, generator=gen) * 0.1 if ".lora_B." in k else v
                                          for k, v in state.items()})
        metrics = []
        for step in range(3):
            seqs = random_sequences(vocab, [9, 4, 7], 40 + step)
            datums = make_datums("cross_entropy", seqs, our_logprobs(backend, "d", seqs), 50 + step)
            backend.forward_backward([TrainRequest("d", datums, "cross_entropy")])
            metrics.append(backend.optim_step("d", DimuonParams(learning_rate=1e-2, grad_clip_norm=0.5)))
        momentum = backend.optimizer_state("d").momentum
        out.put((rank, {"metrics": metrics, "state": numpy_dict(backend.trainable_state("d")),
                        "momentum": numpy_dict(momentum)}))
    except Exception:  # noqa: BLE001
        out.put((rank, traceback.format_exc()))


def test_dimuon_under_tensor_parallelism_equals_one_process(tiny_model_dir) -> None:
    """Each update is orthogonalised whole (Newton-Schulz needs the whole matrix), each rank keeping its part."""
    import torch
    from train_reference import assert_dicts_close

    model_dir = str(tiny_model_dir("tiny-qwen3"))
    runs = {world: spawn_ranks(_dimuon_main, world, lambda r, port, out, w=world: (model_dir, r, w, port, out),
                               TIMEOUT_S, f"dimuon world {world}") for world in (1, 2)}
    single = runs[1][0]
    assert isinstance(single, dict), single
    for rank, got in runs[2].items():
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        for o, e in zip(got["metrics"], single["metrics"], strict=True):
            assert o == pytest.approx(e, rel=5e-5), (rank, o, e)
        for key in ("state", "momentum"):
            assert_dicts_close({k: torch.from_numpy(v) for k, v in got[key].items()},
                               {k: torch.from_numpy(v) for k, v in single[key].items()}, atol=1e-5,
                               what=f"dimuon tp2 rank {rank} {key}")
