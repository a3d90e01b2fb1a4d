"""Bad training requests raise the documented skyrl_tx errors, name what is wrong and leave no partial state."""

from __future__ import annotations

import pytest
import torch
from train_reference import assert_dicts_equal, assert_zero, make_datums, random_sequences

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError, NotFoundError
from skyrl_tx.types import AdamParams, Datum, TrainRequest


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> NativeBackend:
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), BackendSettings(max_lora_adapters=2, max_lora_rank=8))
    backend.create_model("m", lora_rank=4, alpha=8.0, seed=0)
    return backend


def data(backend: NativeBackend, loss_fn: str, lengths=(5, 8), seed: int = 0) -> list[Datum]:
    seqs = random_sequences(backend.decoder_config.vocab_size, list(lengths), seed)
    return make_datums(loss_fn, seqs, [torch.full((len(s) - 1,), -7.0) for s in seqs], seed)


def without(datums: list[Datum], key: str) -> list[Datum]:
    return [Datum(d.input_tokens, {k: v for k, v in d.loss_fn_inputs.items() if k != key}) for d in datums]


def with_input(datums: list[Datum], index: int, key: str, value) -> list[Datum]:
    out = list(datums)
    out[index] = Datum(datums[index].input_tokens, {**datums[index].loss_fn_inputs, key: value})
    return out


def raises_on_both(backend: NativeBackend, requests: list[TrainRequest], error: type, match: str | None = None):
    """forward and forward_backward both reject the requests; neither leaves gradients behind."""
    grads = backend.trainable_grads("m")
    for call in (backend.forward, backend.forward_backward):
        with pytest.raises(error, match=match):
            call(requests)
    assert_dicts_equal(backend.trainable_grads("m"), grads, "grads after a rejected request")


def test_unknown_loss_fn(backend: NativeBackend) -> None:
    raises_on_both(backend, [TrainRequest("m", data(backend, "cross_entropy"), "mse")], InvalidArgumentError)


@pytest.mark.parametrize("loss_fn,key", [
    ("cross_entropy", "weights"),
    ("cross_entropy", "target_tokens"),
    ("importance_sampling", "logprobs"),
    ("importance_sampling", "advantages"),
    ("ppo", "advantages"),
    ("ppo", "logprobs"),
    ("cispo", "advantages"),
    ("dro", "logprobs"),
    ("dro", "target_tokens"),
])
def test_missing_required_input_is_named(backend: NativeBackend, loss_fn: str, key: str) -> None:
    datums = data(backend, loss_fn)
    datums = datums[:1] + without(datums[1:], key)  # only the second datum lacks it
    raises_on_both(backend, [TrainRequest("m", datums, loss_fn)], InvalidArgumentError, match=key)


@pytest.mark.parametrize("loss_fn,config,key", [
    ("ppo", {"clip_low_threshold": 0.7, "clip_lo": 0.5}, "clip_lo"),
    ("cispo", {"not_a_key": 1.0}, "not_a_key"),
    ("dro", {"betta": 0.1}, "betta"),
    ("cross_entropy", {"label_smoothing": 0.1}, "label_smoothing"),
])
def test_unknown_loss_fn_config_key_is_named(backend: NativeBackend, loss_fn: str, config, key: str) -> None:
    raises_on_both(backend, [TrainRequest("m", data(backend, loss_fn), loss_fn, config)], InvalidArgumentError,
                   match=key)


@pytest.mark.parametrize("loss_fn,key,delta", [
    ("cross_entropy", "weights", -1),
    ("cross_entropy", "target_tokens", 1),
    ("ppo", "advantages", -1),
    ("importance_sampling", "logprobs", 2),
    ("dro", "weights", 1),
])
def test_input_of_wrong_length(backend: NativeBackend, loss_fn: str, key: str, delta: int) -> None:
    datums = data(backend, loss_fn)
    n = len(datums[1].input_tokens)
    value = (torch.arange(n + delta) % 7) if key == "target_tokens" else torch.ones(n + delta)
    raises_on_both(backend, [TrainRequest("m", with_input(datums, 1, key, value), loss_fn)], InvalidArgumentError)


def test_bad_request_in_a_batch_leaves_no_partial_gradients(backend: NativeBackend) -> None:
    """Validation happens before any compute: a good request before a bad one accumulates nothing."""
    good = TrainRequest("m", data(backend, "cross_entropy", seed=1))
    bad = TrainRequest("m", without(data(backend, "ppo", seed=2), "advantages"), "ppo")
    assert_zero(backend.trainable_grads("m"))
    raises_on_both(backend, [good, bad], InvalidArgumentError, match="advantages")
    assert_zero(backend.trainable_grads("m"), "grads after a rejected batch")
    # The backend still works afterwards.
    (result,) = backend.forward_backward([good])
    assert [len(o["logprobs"]) for o in result.loss_fn_outputs] == [5, 8]
    assert any(g.any() for g in backend.trainable_grads("m").values())
    backend.optim_step("m", AdamParams(learning_rate=0.0))
    assert_zero(backend.trainable_grads("m"))


def test_unknown_model_is_not_found(backend: NativeBackend) -> None:
    request = TrainRequest("nope", data(backend, "cross_entropy"))
    grads = backend.trainable_grads("m")
    for call in (backend.forward, backend.forward_backward):
        with pytest.raises(NotFoundError):
            call([request])
    with pytest.raises(NotFoundError):  # one unknown model among known ones
        backend.forward_backward([TrainRequest("m", data(backend, "cross_entropy")), request])
    assert_dicts_equal(backend.trainable_grads("m"), grads, "grads after a batch with an unknown model")
    with pytest.raises(NotFoundError):
        backend.optim_step("nope", AdamParams())
    with pytest.raises(NotFoundError):
        backend.trainable_state("nope")
    with pytest.raises(NotFoundError):
        backend.trainable_grads("nope")
    with pytest.raises(NotFoundError):
        backend.remove_model("nope")


def test_removed_model_is_not_found(backend: NativeBackend) -> None:
    backend.create_model("gone", lora_rank=2, alpha=2.0)
    backend.remove_model("gone")
    with pytest.raises(NotFoundError):
        backend.forward_backward([TrainRequest("gone", data(backend, "cross_entropy"))])
    with pytest.raises(NotFoundError):
        backend.trainable_state("gone")


def test_lora_rank_above_max(backend: NativeBackend) -> None:
    with pytest.raises(InvalidArgumentError, match="max_lora_rank"):
        backend.create_model("big", lora_rank=9, alpha=9.0)
    with pytest.raises(NotFoundError):
        backend.trainable_state("big")  # nothing half-created
    backend.create_model("ok", lora_rank=8, alpha=8.0)  # the max itself is fine
    backend.remove_model("ok")
