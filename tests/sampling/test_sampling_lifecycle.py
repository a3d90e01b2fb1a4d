"""A bad request never leaves orphaned work behind, and weights in use by running samples cannot be unloaded."""

from __future__ import annotations

import pytest
import torch

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import ConflictError, InvalidArgumentError
from skyrl_tx.types import SampleRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture()
def backend(tiny_model_dir) -> NativeBackend:
    return NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=2, max_full_models=1))


def test_sample_validates_every_request_before_queueing_any(backend: NativeBackend) -> None:
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        backend.sample([SampleRequest([1, 2, 3], GREEDY), SampleRequest([1, 2, 3], SamplingParams(max_tokens=0))])
    # Nothing of the rejected call is still running or waiting to be handed out.
    backend.sample([SampleRequest([4, 5, 6], GREEDY)])
    assert backend.sample_step() == []


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_unloading_a_model_with_running_samples_is_a_conflict(backend: NativeBackend, lora_rank: int) -> None:
    backend.create_model("m", lora_rank=lora_rank, alpha=8.0)
    request_id = backend.submit_sample(SampleRequest([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0),
                                                     weights_id="m"))
    backend.sample_step()
    with pytest.raises(ConflictError, match="running sample requests"):
        backend.remove_model("m")
    finished = {}
    while request_id not in finished:
        finished.update(backend.sample_step())
    assert len(finished[request_id].sequences[0].tokens) == 20
    backend.remove_model("m")  # idle now: allowed


def test_empty_stop_list_disables_eos(backend: NativeBackend) -> None:
    # An lm_head-only rank-1 adapter that makes EOS overwhelmingly likely at every position.
    backend.create_model("eos", lora_rank=1, alpha=1.0, train_attn=False, train_mlp=False, train_unembed=True)
    state = backend.trainable_state("eos")
    eos = backend.eos_token_ids[0]
    a = torch.ones_like(state["base_model.model.lm_head.lora_A.weight"])
    b = torch.zeros_like(state["base_model.model.lm_head.lora_B.weight"])
    b[eos] = 1000.0
    backend.set_adapter_weights("eos", {"base_model.model.lm_head.lora_A.weight": a,
                                        "base_model.model.lm_head.lora_B.weight": b})
    prompt = [5, 6, 7]  # for this prompt the hidden states sum positive (deterministic preset): EOS dominates

    default = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=5, temperature=0.0),
                                            weights_id="eos")])[0].sequences[0]
    no_stops = backend.sample([SampleRequest(prompt, SamplingParams(max_tokens=5, temperature=0.0, stop=[]),
                                             weights_id="eos")])[0].sequences[0]
    assert default.tokens == [eos] and default.stop_reason == "stop"
    assert no_stops.stop_reason == "length" and len(no_stops.tokens) == 5
