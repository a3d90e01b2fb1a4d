"""Training through the tinker SDK against a live server: forward, forward_backward, custom losses, pipelining,
isolation between training clients, metrics.

Token data are small int lists (tiny-qwen3 has 2112 tokens); no tokenizer is needed. LoRA adapters start with
B = 0 and a seeded A, so two clients created with the same `seed` are identical until trained differently.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tinker import types

BASE_MODEL = "tiny-qwen3"
ALIAS = "Qwen/Qwen3-0.6B"  # served as another name of the same base model (--model-alias)
RANK = 4
LR = 1e-2


@pytest.fixture(scope="module")
def server_options() -> dict[str, Any]:
    # every test makes fresh clients and the SDK cannot unload them: room for 32 adapters
    return {"backend_config": {"max_lora_adapters": 32}, "aliases": (ALIAS,)}


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Position i of the input predicts target i (the SDK's pre-shifted convention)."""
    weights = [1.0] * (len(tokens) - 1) if weights is None else weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


BATCH = [datum([5, 17, 300, 42, 7, 99, 1000]), datum([11, 12, 13, 14], [0.0, 1.0, 0.5]),
         datum([2000, 3, 1500, 8, 640], [1.0, 0.0, 2.0, 1.0])]
BATCHES = [BATCH[:2], [datum([70, 71, 72, 73, 74, 75])], [BATCH[2], datum([9, 900, 90, 9, 900, 90])]]
PROBE = [datum([5, 17, 300, 42, 7, 99, 1000]), datum([123, 456, 789, 1011, 1213])]  # what forward() measures


def new_client(service_client: Any, seed: int) -> Any:
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=seed).result()


def logprobs(result: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [torch.tensor(out["logprobs"].tolist(), dtype=torch.float64) for out in result.loss_fn_outputs]


def probe(client: Any) -> list[torch.Tensor]:
    return logprobs(client.forward(PROBE, "cross_entropy").result())


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def expected_loss(data: list[types.Datum], lps: list[torch.Tensor]) -> float:
    """cross_entropy with sum semantics: -sum(logprobs * weights)."""
    return float(sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].tolist(), dtype=torch.float64)).sum()
                     for d, lp in zip(data, lps)))


def adam() -> types.AdamParams:
    return types.AdamParams(learning_rate=LR)


def test_forward_equals_forward_backward_logprobs(service_client: Any) -> None:
    client = new_client(service_client, seed=1)
    fwd = client.forward(BATCH, "cross_entropy").result()
    fb = client.forward_backward(BATCH, "cross_entropy").result()
    assert [len(lp) for lp in logprobs(fwd)] == [len(d.model_input.to_ints()) for d in BATCH]
    assert max_abs_diff(logprobs(fwd), logprobs(fb)) < 1e-5
    assert fwd.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)
    # forward accumulates no gradient: a forward-only client stepped now is still the initial adapter
    other = new_client(service_client, seed=1)
    other.forward(BATCH, "cross_entropy").result()
    other.optim_step(adam()).result()
    assert max_abs_diff(probe(other), logprobs(client.forward(PROBE, "cross_entropy").result())) < 1e-6


def test_metrics_report_loss_sum(service_client: Any) -> None:
    client = new_client(service_client, seed=2)
    result = client.forward_backward(BATCH, "cross_entropy").result()
    assert "loss:sum" in result.metrics
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss(BATCH, logprobs(result)), rel=1e-5)
    assert [len(lp) for lp in logprobs(result)] == [len(d.model_input.to_ints()) for d in BATCH]
    assert all(bool((lp < 0).all()) for lp in logprobs(result))
    step = client.optim_step(adam()).result()
    assert step.metrics is not None and step.metrics.get("step") == 1


def test_lora_seed_controls_initialization(service_client: Any) -> None:
    """Same seed → the same adapter after the same step; another seed → another adapter (A differs)."""
    runs = []
    for seed in (3, 3, 4):
        client = new_client(service_client, seed=seed)
        client.forward_backward(BATCH, "cross_entropy")
        client.optim_step(adam()).result()
        runs.append(probe(client))
    assert max_abs_diff(runs[0], runs[1]) < 1e-6
    assert max_abs_diff(runs[0], runs[2]) > 1e-4


def test_custom_cross_entropy_matches_builtin(service_client: Any) -> None:
    def custom_ce(data: list[types.Datum], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, lps))
        return loss, {"custom_metric:sum": float(loss.detach())}

    builtin, custom = new_client(service_client, seed=5), new_client(service_client, seed=5)
    before = probe(builtin)
    ref = builtin.forward_backward(BATCH, "cross_entropy")
    ref_step = builtin.optim_step(adam())
    got = custom.forward_backward_custom(BATCH, custom_ce)
    got_step = custom.optim_step(adam())
    ref, got = ref.result(), got.result()
    ref_step, got_step = ref_step.result(), got_step.result()

    assert got.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-4)
    assert got.metrics["custom_metric:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-4)
    # the surrogate pass (cross_entropy with weights -dC/dlogprobs = the datum weights) has the same loss
    assert got.metrics["surrogate_loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-4)
    assert max_abs_diff(logprobs(got), logprobs(ref)) < 1e-4
    assert got_step.metrics["grad_norm"] == pytest.approx(ref_step.metrics["grad_norm"], rel=1e-4)
    after_ref, after_custom = probe(builtin), probe(custom)
    assert max_abs_diff(after_ref, before) > 1e-3  # the step did train
    assert max_abs_diff(after_custom, after_ref) < 1e-4


def test_pipelined_submits_equal_sequential_run(service_client: Any) -> None:
    pipelined, sequential = new_client(service_client, seed=6), new_client(service_client, seed=6)

    futures = [pipelined.forward_backward(batch, "cross_entropy") for batch in BATCHES]
    step_future = pipelined.optim_step(adam())
    after_future = pipelined.forward(PROBE, "cross_entropy")  # submitted before anything is waited on
    piped = [f.result() for f in futures]
    piped_step, piped_after = step_future.result(), after_future.result()

    initial = probe(sequential)
    seq = [sequential.forward_backward(batch, "cross_entropy").result() for batch in BATCHES]
    seq_step = sequential.optim_step(adam()).result()
    seq_after = sequential.forward(PROBE, "cross_entropy").result()

    for p, s in zip(piped, seq):
        assert p.metrics["loss:sum"] == pytest.approx(s.metrics["loss:sum"], abs=1e-5, rel=1e-6)
        assert max_abs_diff(logprobs(p), logprobs(s)) < 1e-5
    assert piped_step.metrics["grad_norm"] == pytest.approx(seq_step.metrics["grad_norm"], rel=1e-5)
    assert piped_step.metrics["step"] == seq_step.metrics["step"] == 1
    assert piped_after.metrics["loss:sum"] == pytest.approx(seq_after.metrics["loss:sum"], abs=1e-5, rel=1e-6)
    assert max_abs_diff(logprobs(piped_after), logprobs(seq_after)) < 1e-5
    assert max_abs_diff(logprobs(seq_after), initial) > 1e-3  # the step did train


def test_training_one_client_leaves_another_unchanged(service_client: Any) -> None:
    a, b = new_client(service_client, seed=7), new_client(service_client, seed=7)
    b_before, a_before = probe(b), probe(a)
    assert max_abs_diff(a_before, b_before) < 1e-6
    # interleave A's training with B's forwards; nothing is waited on until everything is submitted
    futures: list[Any] = []
    b_probes: list[Any] = []
    for batch in BATCHES[:2]:
        futures.append(a.forward_backward(batch, "cross_entropy"))
        b_probes.append(b.forward(PROBE, "cross_entropy"))
        futures.append(a.optim_step(adam()))
        b_probes.append(b.forward(PROBE, "cross_entropy"))
    for f in futures:
        f.result()
    for f in b_probes:
        assert max_abs_diff(logprobs(f.result()), b_before) < 1e-5
    assert max_abs_diff(probe(b), b_before) < 1e-5
    assert max_abs_diff(probe(a), a_before) > 1e-3


def test_concurrent_training_clients_are_isolated(service_client: Any) -> None:
    """A and B train at the same time on different data (their requests share engine passes); B ends where a
    client trained alone on B's data ends, so neither gradients nor optimizer state leak between them."""
    import tinker

    with tinker.ServiceClient() as other_session:  # B lives in another session
        a = new_client(service_client, seed=8)
        b = new_client(other_session, seed=9)
        pending: list[Any] = []
        for a_batch, b_batch in zip(BATCHES, reversed(BATCHES)):
            pending += [a.forward_backward(a_batch, "cross_entropy"), b.forward_backward(b_batch, "cross_entropy")]
            pending += [a.optim_step(adam()), b.optim_step(adam())]
        for f in pending:
            f.result()
        b_after = probe(b)

        alone = new_client(other_session, seed=9)
        for b_batch in reversed(BATCHES):
            alone.forward_backward(b_batch, "cross_entropy")
            alone.optim_step(adam()).result()
        assert max_abs_diff(probe(alone), b_after) < 1e-5


def test_service_client_context_finishes_the_session(tinker_env: str) -> None:
    """`with ServiceClient()` posts sessions/{id}/finish on exit; the server must accept it."""
    import tinker

    with tinker.ServiceClient() as sc:
        client = new_client(sc, seed=10)
        assert client.get_info().model_data.model_name == BASE_MODEL
        assert client.forward(PROBE, "cross_entropy").result().metrics["loss:sum"] > 0


def test_rl_loss_inputs_and_config_reach_the_loss(service_client: Any) -> None:
    """loss_fn_inputs (float arrays) and loss_fn_config (numbers, sent as loss_fn_config and _v2) arrive intact:
    each server loss:sum equals the Tinker formula evaluated on the returned logprobs."""
    client = new_client(service_client, seed=11)
    tokens = [5, 17, 300, 42, 7, 99, 1000]
    lp = logprobs(client.forward([datum(tokens)], "cross_entropy").result())[0]
    q = lp + torch.tensor([0.5, -0.5, 0.05, -2.0, 2.0, 0.0], dtype=torch.float64)  # ratios inside and outside clips
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 1.5], dtype=torch.float64)
    w = torch.tensor([1.0, 0.5, 0.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    rl = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": q.tolist(), "advantages": adv.tolist(),
                                     "weights": w.tolist()})
    ratio = torch.exp(lp - q)

    def ppo(lo: float, hi: float) -> float:
        return float((-torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv) * w).sum())

    cases = [("importance_sampling", None, float((-ratio * adv * w).sum())),
             ("ppo", None, ppo(0.8, 1.2)),
             ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, ppo(0.9, 1.1)),
             ("dro", {"beta": 0.5}, float((-(lp * adv - 0.25 * (lp - q) ** 2) * w).sum()))]
    futures = [client.forward([rl], loss_fn, config) for loss_fn, config, _ in cases]
    for (loss_fn, config, expected), future in zip(cases, futures):
        out = future.result()
        assert max_abs_diff(logprobs(out), [lp]) < 1e-5
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5), (loss_fn, config)
    assert ppo(0.9, 1.1) != pytest.approx(ppo(0.8, 1.2), rel=1e-3)  # the config case is distinguishable


def test_forward_backward_split_into_parallel_chunks(service_client: Any) -> None:
    """More than fwdbwd_max_chunk_len (1024) datums: the SDK sends parallel chunks (the first one last) and merges
    the results; the server's answers must line up with the chunks, and the step sees every chunk's gradient."""
    data = [datum([i % 2000 + 1, (7 * i) % 2000 + 3, (13 * i) % 2000 + 5]) for i in range(1100)]
    chunked, split = new_client(service_client, seed=12), new_client(service_client, seed=12)
    whole = chunked.forward_backward(data, "cross_entropy")
    whole_step = chunked.optim_step(adam())
    parts = [split.forward_backward(data[:1024], "cross_entropy"), split.forward_backward(data[1024:], "cross_entropy")]
    split_step = split.optim_step(adam())
    whole, parts = whole.result(), [p.result() for p in parts]
    assert len(whole.loss_fn_outputs) == len(data)
    assert max_abs_diff(logprobs(whole), logprobs(parts[0]) + logprobs(parts[1])) < 1e-5
    assert whole.metrics["loss:sum"] == pytest.approx(sum(p.metrics["loss:sum"] for p in parts), rel=1e-6)
    assert whole_step.result().metrics["grad_norm"] == pytest.approx(split_step.result().metrics["grad_norm"], rel=1e-5)
    assert max_abs_diff(probe(chunked), probe(split)) < 1e-5


def test_get_info_describes_the_model(service_client: Any) -> None:
    client = new_client(service_client, seed=13)
    info = client.get_info()
    assert info.model_id == client.model_id
    assert re.fullmatch(r"[^:/]+:train:\d+", info.model_id), info.model_id  # <session_id>:train:<model_seq_id>
    assert info.model_data.model_name == BASE_MODEL and info.model_data.arch == "Qwen3ForCausalLM"
    assert info.is_lora is True and info.lora_rank == RANK


def test_rank_zero_is_full_fine_tuning(service_client: Any) -> None:
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()
    info = client.get_info()
    assert info.is_lora is False and info.lora_rank is None
    losses = []
    for _ in range(3):
        fb = client.forward_backward(BATCH, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[2] < losses[1] < losses[0]


def test_unseeded_clients_get_different_initializations(service_client: Any) -> None:
    runs = []
    for _ in range(2):
        client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK).result()
        client.forward_backward(BATCH, "cross_entropy")
        client.optim_step(adam()).result()
        runs.append(probe(client))
    assert max_abs_diff(runs[0], runs[1]) > 1e-6


def test_model_alias_is_served(service_client: Any) -> None:
    client = service_client.create_lora_training_client(base_model=ALIAS, rank=RANK, seed=14).result()
    assert client.get_info().model_data.model_name == ALIAS
    twin = new_client(service_client, seed=14)  # the same weights under the preset's own name
    assert max_abs_diff(probe(client), probe(twin)) < 1e-6
    sampler = client.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == ALIAS
    lps = sampler.compute_logprobs(types.ModelInput.from_ints([5, 17, 300, 42])).result()
    assert lps[0] is None and len(lps) == 4
    base = service_client.create_sampling_client(base_model=ALIAS).result()
    assert base.compute_logprobs(types.ModelInput.from_ints([5, 17, 300, 42])).result()[1:] == \
        pytest.approx(lps[1:], abs=1e-5)
