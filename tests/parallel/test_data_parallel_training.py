"""Data-parallel forward_backward on real processes (Gloo): every rank computes its share of the rows (split by
tokens) and ends with the results and weights of one process — LoRA tenants (one on a custom loss) and a full
fine-tune in one batch, ragged batches whose row count is no multiple of the rank count, three AdamW steps — while
holding only its ZeRO range of the full fine-tune's gradients and AdamW moments."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
from live_server import free_port
from rank_reports import rank_context, rank_process

TIMEOUT_S = 240.0
MODELS = ("a", "b", "full", "full2")  # two full fine-tunes: their gradients must never mix across ranks
# Per model, the input lengths of its datums in each of the 3 steps: 11 rows a step (no multiple of 2 or 3), one
# step where a model has a single row.
LENGTHS = [{"a": [11, 4, 7], "b": [9, 3], "full": [6, 5], "full2": [4, 3, 6, 2]},
           {"a": [5], "b": [12, 2, 8, 6], "full": [10, 3], "full2": [7, 2, 3, 6]},
           {"a": [8, 8, 3], "b": [4], "full": [7, 9, 2], "full2": [5, 5, 2, 8]}]


def weighted_nll(logprobs, weights):  # model "a" trains on it as a create_custom_loss graph
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/tokens:mean": logprobs.shape[0] * (weights > 0).float().mean()}


def _custom_loss_graph() -> Any:
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    from skyrl_tx.types import CustomLossGraph

    handle = trace_loss(weighted_nll, {"logprobs": 1, "weights": 1}, "session")
    return CustomLossGraph("loss-a", handle.name, tuple(i.name for i in handle.inputs),
                           tuple(i.rank for i in handle.inputs), encode_graph(handle).model_dump()["nodes"])


def _train(model_dir: str, rank: int, world: int, port: int) -> dict[str, Any]:
    """The same 3 steps on every rank (world 1: one process, no group). Returns per-step outputs and the final
    trainable state of every model."""
    import torch
    from train_reference import ROBUST_ADAM, create_lora_with_nonzero_b, make_datums, our_logprobs, random_sequences

    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.config import BackendSettings
    from skyrl_tx.parallel.group import RankAddress, join_group
    from skyrl_tx.types import TrainRequest

    torch.manual_seed(0)
    # zero_bucket_mb=1: the full model's 344k float32 parameters (1.3 MB) move in two ZeRO buckets
    backend = NativeBackend(model_dir, BackendSettings(max_lora_adapters=2, max_lora_rank=4, max_full_models=2,
                                                       train_micro_batch_tokens=24, zero_bucket_mb=1))
    create_lora_with_nonzero_b(backend, "a", rank=4, alpha=8.0, seed=1, b_seed=2)
    create_lora_with_nonzero_b(backend, "b", rank=2, alpha=4.0, seed=3, b_seed=4)
    backend.create_model("full", lora_rank=0)
    backend.create_model("full2", lora_rank=0)
    vocab = backend.decoder_config.vocab_size
    steps = []
    for step, lengths in enumerate(LENGTHS):
        requests = []
        for i, model_id in enumerate(MODELS):  # built before the group: forward here is one process's
            seqs = random_sequences(vocab, lengths[model_id], 100 * step + 10 * i)
            loss_fn = "ppo" if model_id == "b" else "cross_entropy"
            datums = make_datums(loss_fn, seqs, our_logprobs(backend, model_id, seqs), 100 * step + 10 * i + 1)
            if model_id == "a":
                requests.append(TrainRequest(model_id, datums, "custom", custom_loss=_custom_loss_graph()))
            else:
                requests.append(TrainRequest(model_id, datums, loss_fn))
        if step == 0 and world > 1:
            backend.attach_collectives(join_group(RankAddress(f"127.0.0.1:{port}", rank, world), device="cpu",
                                                             timeout_s=60))
        results = backend.forward_backward(requests)
        steps.append([{"metrics": dict(r.metrics),
                       "outputs": [{k: torch.as_tensor(v).numpy().copy() for k, v in out.items()}
                                   for out in r.loss_fn_outputs]} for r in results])
        if step == len(LENGTHS) - 1:  # the summed gradients, gathered from the ZeRO ranges for the full model
            grads = {m: numpy_dict(backend.trainable_grads(m)) for m in MODELS}
            pending_bytes = backend.optimizer_state_bytes("full")
        for model_id in MODELS:
            backend.optim_step(model_id, ROBUST_ADAM)
    optimizer = backend.optimizer_state("full")  # every rank: gathers the ZeRO ranges
    moments = {"exp_avg": numpy_dict(optimizer.exp_avg), "exp_avg_sq": numpy_dict(optimizer.exp_avg_sq)}
    state_bytes = backend.optimizer_state_bytes("full")
    # Loading the gathered state back keeps each rank's range: the same state gathers again.
    backend.set_optimizer_state("full", optimizer.step, optimizer.exp_avg, optimizer.exp_avg_sq)
    reloaded = backend.optimizer_state("full")
    assert all(torch.equal(reloaded.exp_avg[k], optimizer.exp_avg[k]) for k in optimizer.exp_avg)
    return {"steps": steps, "state": {m: numpy_dict(backend.trainable_state(m)) for m in MODELS}, "grads": grads,
            "moments": moments, "step": optimizer.step, "state_bytes": state_bytes, "pending_bytes": pending_bytes}


def numpy_dict(tensors: dict) -> dict:
    # numpy, not tensors: a tensor crosses the queue as a shared-memory handle that dies with this process
    return {k: v.numpy().copy() for k, v in tensors.items()}


def _rank_main(model_dir: str, rank: int, world: int, port: int, out: Any) -> None:
    try:
        out.put((rank, _train(model_dir, rank, world, port)))
    except Exception:  # noqa: BLE001
        out.put((rank, traceback.format_exc()))


def _run_ranks(model_dir: str, world: int) -> dict[int, Any]:
    context = rank_context()
    out, port = context.Queue(), free_port()
    procs = [rank_process(context, _rank_main, (model_dir, r, world, port, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=TIMEOUT_S) for _ in procs)
    for p in procs:
        p.join(TIMEOUT_S)
    return results


@pytest.fixture(scope="module")
def one_process(tiny_model_dir) -> dict[str, Any]:
    """The reference every world size is held to: the same steps in one process (computed once for the module)."""
    single = _run_ranks(str(tiny_model_dir("tiny-qwen3")), 1)[0]
    assert isinstance(single, dict), single
    return single


@pytest.mark.parametrize("world", [2, 3, 4])
def test_data_parallel_equals_one_process(tiny_model_dir, one_process, world: int) -> None:
    import torch
    from train_reference import assert_dicts_close

    def tensors(d: dict) -> dict:
        return {k: torch.from_numpy(v) for k, v in d.items()}

    single = one_process
    ranks = _run_ranks(str(tiny_model_dir("tiny-qwen3")), world)
    for rank, got in ranks.items():
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        for step, (ours, ref) in enumerate(zip(got["steps"], single["steps"])):
            for r, (o, e) in enumerate(zip(ours, ref)):
                assert o["metrics"] == pytest.approx(e["metrics"], rel=1e-6, abs=1e-6), (rank, step, r)
                assert ("custom/nll:sum" in o["metrics"]) == (r == 0), o["metrics"]  # model "a": the custom loss
                assert len(o["outputs"]) == len(e["outputs"])
                # Per-token losses after AdamW steps whose gradients were summed in another order: 1e-5 of the largest
                # (~3.5), as for the state below. 1e-6 held on one CPU and missed by 3.58e-6 against 3.54e-6 (15 ulps)
                # on an AVX-512 one, with every fused CPU op off.
                for d, (od, ed) in enumerate(zip(o["outputs"], e["outputs"])):
                    assert_dicts_close(tensors(od), tensors(ed), atol=1e-5,
                                       what=f"rank {rank} step {step} request {r} datum {d}")
        for model_id in MODELS:
            assert_dicts_close(tensors(got["state"][model_id]), tensors(single["state"][model_id]), atol=1e-5,
                               what=f"rank {rank} {model_id} after 3 steps")
            assert_dicts_close(tensors(got["grads"][model_id]), tensors(single["grads"][model_id]), atol=1e-5,
                               what=f"rank {rank} {model_id} gradients of step 3")
        assert got["step"] == single["step"] == len(LENGTHS)
        for moment in ("exp_avg", "exp_avg_sq"):
            assert_dicts_close(tensors(got["moments"][moment]), tensors(single["moments"][moment]), atol=1e-6,
                               what=f"rank {rank} full model {moment} after 3 steps")
        # ZeRO: each rank holds its range (1/world of the model, plus at most one bucket's padding) of the full
        # model's float32 gradients and moments (before step 3: gradients + 2 moments; after it: the moments).
        params = sum(v.size for v in single["moments"]["exp_avg"].values())
        assert (single["pending_bytes"], single["state_bytes"]) == (3 * 4 * params, 2 * 4 * params)
        shard, bucket = got["state_bytes"] // (2 * 4), (1 << 20) // 4
        assert got["pending_bytes"] == 3 * 4 * shard
        assert params <= world * shard < params + bucket, (shard, params, world)
