"""gspo and stable_reinforce through the real tinker SDK against a live server, built as tinker-cookbook 0.6.1's
rl_loop builds them (sampled with record_stability_info, stable_reinforce datums with provenance spans, gspo with
sequence_ratio_mask); bad inputs are user errors that name what is wrong."""

from __future__ import annotations

from typing import Any

import pytest
import tinker
import torch
from tinker import types

BASE_MODEL = "tiny-qwen3"
PROMPT = [5, 17, 300, 42, 7, 99]


@pytest.fixture(scope="module")
def training_client(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()


def lps(result: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [torch.tensor(out["logprobs"].tolist(), dtype=torch.float64) for out in result.loss_fn_outputs]


def user_failure(future: Any) -> tinker.RequestFailedError:
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result()
    assert info.value.category == "user", f"category {info.value.category!r}: {info.value.message}"
    return info.value


def rollouts(training_client: Any) -> list[tuple[list[int], list[float], str, float]]:
    """(sampled tokens, their logprobs, sequence_id, advantage) for 4 samples of PROMPT, as rl_loop collects them."""
    sampler = training_client.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    result = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params).result()
    out = []
    for i, seq in enumerate(result.sequences):
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens) and seq.sequence_id
        out.append((list(seq.tokens), list(seq.logprobs), seq.sequence_id, [1.0, -0.5, 0.25, -0.75][i]))
    return out


def rl_datum(tokens: list[int], logprobs: list[float], advantage: float, sequence_id: str, loss_fn: str) -> types.Datum:
    """tinker_cookbook/recipes/rl_loop.py's datum: prompt positions padded with 0 (target, logprob, advantage)."""
    ob_len = len(PROMPT) - 1
    model_input = types.ModelInput.from_ints(PROMPT + tokens[:-1])
    inputs: dict[str, Any] = {"target_tokens": [0] * ob_len + tokens, "logprobs": [0.0] * ob_len + logprobs,
                              "advantages": [0.0] * ob_len + [advantage] * len(tokens)}
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = [0.0] * ob_len + [1.0] * len(tokens)
    datum = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
    if loss_fn == "stable_reinforce":  # rl_loop.with_sampled_provenance
        datum = datum.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, length=len(PROMPT)),
                         types.SampledProvenanceSpan(sequence_id=sequence_id, length=len(tokens) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(PROMPT) - 1),
                            types.SampledProvenanceSpan(sequence_id=sequence_id, length=len(tokens))])
    return datum


def expected_loss(loss_fn: str, config: dict[str, float] | None, data: list[types.Datum],
                  logprobs: list[torch.Tensor]) -> float:
    """The server's formula (csrc/loss/losses.cpp) on the logprobs it returned."""
    total = 0.0
    for d, lp in zip(data, logprobs):
        q = torch.tensor(d.loss_fn_inputs["logprobs"].tolist(), dtype=torch.float64)
        adv = torch.tensor(d.loss_fn_inputs["advantages"].tolist(), dtype=torch.float64)
        if loss_fn == "gspo":
            cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **(config or {})}
            mask = torch.tensor(d.loss_fn_inputs["sequence_ratio_mask"].tolist()) != 0
            s = torch.exp((lp - q)[mask].mean())
            clipped = s.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
            total += float((-torch.minimum(s * adv, clipped * adv)).sum())
        else:
            kl = {"kl_coeff": 0.01, **(config or {})}["kl_coeff"]
            total += float((-adv * lp + kl * (torch.exp(lp - q) - 1 - (lp - q))).sum())
    return total


@pytest.mark.parametrize("loss_fn,config", [("stable_reinforce", None), ("stable_reinforce", {"kl_coeff": 0.5}),
                                            ("gspo", None),
                                            ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})])
def test_cookbook_rl_step_trains(service_client: Any, loss_fn: str, config: dict[str, float] | None) -> None:
    client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    data = [rl_datum(*r[:2], r[3], r[2], loss_fn) for r in rollouts(client)]
    probe = [types.Datum(model_input=d.model_input,
                         loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                         "weights": [1.0] * d.model_input.length}) for d in data]
    before = lps(client.forward(probe, "cross_entropy").result())

    fb = client.forward_backward(data, loss_fn, config)
    step = client.optim_step(types.AdamParams(learning_rate=1e-2))
    fb, step = fb.result(), step.result()
    got = lps(fb)
    assert [len(lp) for lp in got] == [d.model_input.length for d in data]
    assert max(float((a - b).abs().max()) for a, b in zip(got, before)) < 1e-5
    assert fb.metrics["loss:sum"] == pytest.approx(expected_loss(loss_fn, config, data, got), rel=1e-4, abs=1e-5)
    assert step.metrics["grad_norm"] > 0
    after = lps(client.forward(probe, "cross_entropy").result())
    assert max(float((a - b).abs().max()) for a, b in zip(after, before)) > 1e-4  # the step did train


def test_missing_loss_input_is_named(training_client: Any) -> None:
    (tokens, logprobs, sequence_id, _), *_ = rollouts(training_client)
    for loss_fn in ("stable_reinforce", "gspo"):
        datum = rl_datum(tokens, logprobs, 1.0, sequence_id, loss_fn)
        del datum.loss_fn_inputs["advantages"]
        error = user_failure(training_client.forward_backward([datum], loss_fn))
        assert "advantages" in error.message, error.message


def test_bad_gspo_mask_and_config_are_named(training_client: Any) -> None:
    (tokens, logprobs, sequence_id, _), *_ = rollouts(training_client)
    datum = rl_datum(tokens, logprobs, 1.0, sequence_id, "gspo")
    datum.loss_fn_inputs["sequence_ratio_mask"] = types.TensorData(data=[1.0], dtype="float32", shape=[1])
    assert "sequence_ratio_mask" in user_failure(training_client.forward_backward([datum], "gspo")).message
    datum = rl_datum(tokens, logprobs, 1.0, sequence_id, "stable_reinforce")
    assert "beta" in user_failure(training_client.forward_backward([datum], "stable_reinforce",
                                                                   {"beta": 0.1})).message
    # A client can still train after the failures.
    assert training_client.forward_backward([datum], "stable_reinforce").result().metrics["loss:sum"] != 0.0


def test_custom_without_a_loss_id_is_a_bad_request(training_client: Any) -> None:
    """SDK 0.38 sends loss_fn="custom" with {"loss_id": ...} for a server-side custom loss (client config
    custom_loss_server_side, tests/api/test_custom_losses_api.py); a hand-sent "custom" without one is refused."""
    assert training_client.holder._client_config.custom_loss_server_side is True
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match="loss_id"):
        training_client.forward_backward([datum], "custom").result()
