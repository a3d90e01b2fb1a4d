"""Split layouts against one process: every rank of a tensor-, data- or expert-parallel group (Gloo, spawned
processes) runs the same calls — two LoRA tenants and a full fine-tune trained for three steps, their weights,
gradients and moments read whole, sampling, a one-process checkpoint loaded — and each rank's results must equal one
process's (_assert_same). Shared by tests/parallel/test_tensor_parallel.py and test_expert_parallel.py."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import pytest
from rank_reports import spawn_ranks

TIMEOUT_S = 240.0
MODELS = ("a", "b", "full")  # two LoRA tenants and a full fine-tune (under DP x TP: ZeRO-2 over each part's replicas)
# Per model, the input lengths of its datums in each of the 3 steps (7 rows a step: no multiple of 2).
LENGTHS = [{"a": [11, 4, 7], "b": [9, 3, 5, 2], "full": [6, 5]}, {"a": [5], "b": [12, 2, 8, 6, 3, 4], "full": [7]},
           {"a": [8, 8, 3], "b": [4], "full": [9, 2, 4]}]
CHECK_LENGTHS, CHECK_SEED = [10, 6], 99  # sequences whose logprobs under "b" check a loaded checkpoint


def numpy_dict(tensors: dict) -> dict:
    # numpy, not tensors: a tensor crosses the queue as a shared-memory handle that dies with this process
    return {k: v.numpy().copy() for k, v in tensors.items()}


def split_backend(model_dir: str, rank: int, world: int, tp: int, port: int, experts: str = "") -> Any:
    """experts: "" whole on every rank, "tp" spread over the tensor-parallel ranks, "dp" over the data-parallel ones;
    a "-checkpointed" suffix turns activation checkpointing on (each layer's exchanges rerun in backward), a
    "-grouped" suffix runs the experts as grouped GEMMs (grouped_expert_gemm "always")."""
    from skyrl_tx.backend.native import NativeBackend
    from skyrl_tx.config import BackendSettings
    from skyrl_tx.parallel.group import RankAddress, join_group, join_subgroups
    from skyrl_tx.parallel.layout import RankLayout

    layout = experts.removesuffix("-checkpointed").removesuffix("-grouped")
    settings = BackendSettings(max_lora_adapters=2, max_lora_rank=4, train_micro_batch_tokens=24,
                               max_sampling_sequences=4, max_sampling_length=64, max_full_models=1,
                               fully_sharded_data_parallel_size=world // tp,
                               expert_parallel_size={"tp": tp, "dp": world // tp}.get(layout, 1),
                               gradient_checkpointing=experts.endswith("-checkpointed"),
                               grouped_expert_gemm="always" if experts.endswith("-grouped") else "auto")
    if world == 1:
        return NativeBackend(model_dir, settings)
    layout = RankLayout(world, 1, f"127.0.0.1:{port}", tp)
    join_group(RankAddress(layout.coordinator_address, rank, world), device=settings.device, timeout_s=60)
    tensor_parallel, data_parallel = join_subgroups(rank, layout.tensor_parallel_groups(),
                                                    layout.data_parallel_groups(), timeout_s=60)
    backend = NativeBackend(model_dir, settings, tensor_parallel=tensor_parallel,
                            expert_parallel=data_parallel if settings.experts_over_data_parallel else None)
    if data_parallel is not None:
        backend.attach_collectives(data_parallel)
        backend.data_parallel_group = data_parallel  # for its counters (the test's, not the backend's)
    return backend


def _run_calls(model_dir: str, rank: int, world: int, tp: int, port: int, checkpoint: dict | None,
         experts: str = "") -> dict[str, Any]:
    """The same calls on every rank (world 1: one process, no group). Returns what each call gave."""
    import torch
    from train_reference import ROBUST_ADAM, make_datums, our_logprobs, random_sequences

    from skyrl_tx.types import SampleRequest, SamplingParams, TrainRequest

    torch.manual_seed(0)
    from skyrl_tx.errors import InvalidArgumentError

    backend = split_backend(model_dir, rank, world, tp, port, experts)
    vocab = backend.decoder_config.vocab_size
    backend.create_model("a", lora_rank=4, alpha=8.0, seed=1)
    backend.create_model("b", lora_rank=2, alpha=4.0, seed=3)
    models = MODELS
    if experts.startswith("dp"):  # not built: refused by name, before anything is copied
        with pytest.raises(InvalidArgumentError, match="full fine-tuning .* data-parallel ranks is not built"):
            backend.create_model("full", lora_rank=0)
        models = ("a", "b")
    else:
        backend.create_model("full", lora_rank=0)
    # Nonzero B (so dL/dA != 0), the same whole tensors on every layout: set whole, kept in parts.
    gen = torch.Generator().manual_seed(2)
    for model_id in ("a", "b"):
        state = backend.trainable_state(model_id)
        backend.set_trainable_state(model_id, {k: (torch.randn(v.shape, generator=gen) * 0.1 if ".lora_B." in k
                                                   else v) for k, v in state.items()})
    check_seqs = random_sequences(vocab, CHECK_LENGTHS, CHECK_SEED)
    out: dict[str, Any] = {"initial": {m: numpy_dict(backend.trainable_state(m)) for m in models}, "steps": [],
                           "initial_logprobs": [t.numpy().copy() for t in our_logprobs(backend, "b", check_seqs)]}
    for step, lengths in enumerate(LENGTHS):
        requests = []
        for i, model_id in enumerate(models):
            seqs = random_sequences(vocab, lengths[model_id], 100 * step + 10 * i)
            loss_fn = "ppo" if model_id == "b" else "cross_entropy"
            datums = make_datums(loss_fn, seqs, our_logprobs(backend, model_id, seqs), 100 * step + 10 * i + 1)
            requests.append(TrainRequest(model_id, datums, loss_fn))
        results = backend.forward_backward(requests)
        record = {"results": [{"metrics": dict(r.metrics),
                               "outputs": [{k: torch.as_tensor(v).numpy().copy() for k, v in o.items()}
                                           for o in r.loss_fn_outputs]} for r in results]}
        if step == len(LENGTHS) - 1:
            record["grads"] = {m: numpy_dict(backend.trainable_grads(m)) for m in models}
        record["optim"] = [backend.optim_step(m, ROBUST_ADAM) for m in models]
        out["steps"].append(record)
    group = getattr(backend, "data_parallel_group", None)
    out["collective_calls"] = {k: s.calls for k, s in group.stats().items()} if group is not None else {}
    out["state"] = {m: numpy_dict(backend.trainable_state(m)) for m in models}
    out["state_bytes"] = backend.optimizer_state_bytes("a")  # this rank's moments: of its parts only
    optimizer = backend.optimizer_state("a")
    out["moments"] = {"exp_avg": numpy_dict(optimizer.exp_avg), "exp_avg_sq": numpy_dict(optimizer.exp_avg_sq)}
    # Loading the whole moments back keeps each rank's part: the same state gathers again.
    backend.set_optimizer_state("a", optimizer.step, optimizer.exp_avg, optimizer.exp_avg_sq)
    again = backend.optimizer_state("a")
    assert all(torch.equal(again.exp_avg[k], optimizer.exp_avg[k]) for k in optimizer.exp_avg)

    prompt = random_sequences(vocab, [9], 7)[0]
    requests = [SampleRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop=[]), weights_id="a",
                              prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2),
                SampleRequest(prompt[:5], SamplingParams(max_tokens=10, temperature=1.0, seed=5, stop=[]),
                              num_samples=2, weights_id="b")]
    backend.snapshot("a", "a@3")  # a frozen version in a snapshot slot of its own
    requests.append(SampleRequest(prompt[:6], SamplingParams(max_tokens=8, temperature=0.0, stop=[]),
                                  weights_id="a@3"))
    if "full" in models:  # a frozen copy of the full fine-tune's parts
        backend.snapshot("full", "full@3")
        requests.append(SampleRequest(prompt[:7], SamplingParams(max_tokens=8, temperature=0.0, stop=[]),
                                      weights_id="full@3", topk_sample_logprobs=2))
        out["frozen"] = numpy_dict(backend.frozen_model_weights("full@3"))
    out["samples"] = [[(s.tokens, s.logprobs, s.topk_logprobs) for s in r.sequences] + [r.prompt_logprobs,
                                                                                       r.topk_prompt_logprobs]
                      for r in backend.sample(requests)]
    out["token_logprobs"] = [t.numpy().copy() for t in backend.token_logprobs([prompt[:-1]], [prompt[1:]], ["b"])]
    if checkpoint is not None:  # one process's adapter "b" before training, loaded into this layout
        backend.set_trainable_state("b", {k: torch.from_numpy(v) for k, v in checkpoint.items()})
        out["loaded_logprobs"] = [t.numpy().copy() for t in our_logprobs(backend, "b", check_seqs)]
    return out


def _rank_main(model_dir: str, rank: int, world: int, tp: int, port: int, checkpoint: dict | None, out: Any,
               experts: str = "") -> None:
    try:
        out.put((rank, _run_calls(model_dir, rank, world, tp, port, checkpoint, experts)))
    except Exception:  # noqa: BLE001
        out.put((rank, traceback.format_exc()))


def run_split_ranks(model_dir: str, world: int, tp: int, checkpoint: dict | None = None,
               experts: str = "") -> dict[int, Any]:
    return spawn_ranks(_rank_main, world, lambda r, port, out: (model_dir, r, world, tp, port, checkpoint, out,
                                                                experts),
                       TIMEOUT_S, f"tensor parallel world {world} tp {tp}")


_ONE_PROCESS: dict[str, Any] = {}  # model_dir -> its one-process run, per pytest process (xdist worker)


def one_process_reference(model_dir: str) -> dict:
    """`run_split_ranks(model_dir, 1, 1)`, run once per model directory and process: the tensor- and expert-parallel
    tests hold several layouts of one preset to the same one-process run (tiny-qwen3-moe's five layouts ran it five
    times). Callers read it and never change it."""
    if model_dir not in _ONE_PROCESS:
        single = run_split_ranks(model_dir, 1, 1)[0]
        assert isinstance(single, dict), single
        _ONE_PROCESS[model_dir] = single
    return _ONE_PROCESS[model_dir]


def assert_same_as_one_process(got: dict, single: dict, what: str) -> None:
    import torch
    from train_reference import assert_dicts_close

    def tensors(d: dict) -> dict:
        return {k: torch.from_numpy(v) for k, v in d.items()}

    models = tuple(got["state"])  # without the full fine-tune under DP x TP
    for model_id in models:
        assert_dicts_close(tensors(got["initial"][model_id]), tensors(single["initial"][model_id]), atol=0,
                           what=f"{what} {model_id} before training")
    if "full" in models:  # the frozen copy's parts, gathered: the one-process frozen copy
        assert_dicts_close(tensors(got["frozen"]), tensors(single["frozen"]), atol=1e-5, what=f"{what} frozen full")
    for step, (ours, ref) in enumerate(zip(got["steps"], single["steps"], strict=True)):
        for r, (o, e) in enumerate(zip(ours["results"], ref["results"][: len(ours["results"])], strict=True)):
            # Sums over ~40 tokens of float32 losses summed in another order (rows split, heads split): seen 1.07e-6.
            assert o["metrics"] == pytest.approx(e["metrics"], rel=5e-6, abs=1e-6), (what, step, r)
            # Per-token outputs: 5e-6 of the largest. 1e-6 missed on an AVX-512 machine (tiny-qwen3.5-moe dp2 experts,
            # step 0: 2.38e-6 at a scale of 2.21, ~9 ulps; fused RoPE on, which equals ATen bit for bit).
            for d, (od, ed) in enumerate(zip(o["outputs"], e["outputs"], strict=True)):
                assert_dicts_close(tensors(od), tensors(ed), atol=5e-6, what=f"{what} step {step} request {r} "
                                                                              f"datum {d}")
        # grad_norm: the whole gradient's norm. Each tensor's norm is a float32 reduction (at::_foreach_norm), ~1e-5
        # from float64 on its own for tiny-llama3's full model (57.58494 vs 57.58589); a split tensor's parts reduce
        # in another order.
        for o, e in zip(ours["optim"], ref["optim"][: len(ours["optim"])], strict=True):
            assert o == pytest.approx(e, rel=5e-5), (what, step)
    for model_id in models:
        assert_dicts_close(tensors(got["steps"][-1]["grads"][model_id]),
                           tensors(single["steps"][-1]["grads"][model_id]), atol=1e-5,
                           what=f"{what} {model_id} gradients of step 3")
        assert_dicts_close(tensors(got["state"][model_id]), tensors(single["state"][model_id]), atol=1e-5,
                           what=f"{what} {model_id} after 3 steps")
    for moment in ("exp_avg", "exp_avg_sq"):
        assert_dicts_close(tensors(got["moments"][moment]), tensors(single["moments"][moment]), atol=1e-6,
                           what=f"{what} a {moment}")
    for r, (ours, ref) in enumerate(zip(got["samples"], single["samples"][: len(got["samples"])], strict=True)):
        for s, (o, e) in enumerate(zip(ours[:-2], ref[:-2], strict=True)):
            assert o[0] == e[0], f"{what} request {r} sample {s}: tokens {o[0]} != one process's {e[0]}"
            np.testing.assert_allclose(o[1], e[1], atol=1e-4, err_msg=f"{what} request {r} sample {s} logprobs")
            if e[2] is not None:
                assert [[t for t, _ in row] for row in o[2]] == [[t for t, _ in row] for row in e[2]]
        if ref[-2] is not None:
            np.testing.assert_allclose([x for x in ours[-2] if x is not None], [x for x in ref[-2] if x is not None],
                                       atol=1e-5, err_msg=f"{what} request {r} prompt logprobs")
            assert [[t for t, _ in row] if row else row for row in ours[-1]] == \
                   [[t for t, _ in row] if row else row for row in ref[-1]], f"{what} request {r} top-k prompt ids"
    # Split, not replicated: each rank's AdamW moments cover its shard of B (column-split layers, the lm_head's
    # vocabulary rows) and of A (row-split layers) plus the replicated factors (and MoE experts' adapters, which are
    # replicated): less than one process's.
    limit = 1.0 if "moe tp2" in what else 0.8  # experts whole on every rank: most of a MoE adapter
    assert got["state_bytes"] < limit * single["state_bytes"], (what, got["state_bytes"], single["state_bytes"])
    for o, e in zip(got["initial_logprobs"], single["initial_logprobs"], strict=True):
        np.testing.assert_allclose(o, e, atol=1e-6, err_msg=f"{what} forward logprobs before training")
    for o, e in zip(got["token_logprobs"], single["token_logprobs"], strict=True):
        np.testing.assert_allclose(o, e, atol=1e-5, err_msg=f"{what} token_logprobs")
