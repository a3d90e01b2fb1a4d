"""Stability records through the real SDK: a sampling client made with record_stability_info=True records its
samples, and stable_reinforce datums that name them in provenance spans (Datum.with_provenance, as the cookbook's
RL recipes build them) train. A span naming an unknown sequence, a sequence sampled without recording, tokens other
than the sequence's, positions past its end, another session's record or an expired record is a user error naming
the sequence. Other losses take spans as provenance only (but spans must tile their field for every loss)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

BASE_MODEL = "tiny-qwen3"
PROMPT = [5, 17, 300, 42, 7]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def trainer(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()


@pytest.fixture(scope="module")
def recorded(service_client: Any) -> list[types.SampledSequence]:
    sampler = service_client.create_sampling_client(base_model=BASE_MODEL, record_stability_info=True).result()
    return list(sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result(timeout=120).sequences)


def datum(seq: types.SampledSequence, tokens: list[int] | None = None) -> types.Datum:
    """The cookbook's shape: prompt + sampled tokens shifted by one, spans naming where each position came from."""
    sampled = list(seq.tokens) if tokens is None else tokens
    full = PROMPT + sampled
    n = len(sampled)
    base = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "logprobs": [0.0] * (len(PROMPT) - 1) + list(seq.logprobs or [0.0] * n),
        "advantages": [0.0] * (len(PROMPT) - 1) + [1.0] * n})
    sid = seq.sequence_id
    return base.with_provenance(
        model_input=[tinker.PromptProvenanceSpan(sequence_id=sid, offset=0, length=len(PROMPT)),
                     tinker.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n - 1)],
        loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 1),
                        tinker.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n)])


def renamed(d: types.Datum, sequence_id: str) -> types.Datum:
    """The same datum with every span naming `sequence_id`."""
    def swap(spans: Any) -> list[Any]:
        return [type(s)(sequence_id=sequence_id, offset=s.offset, length=s.length) for s in spans]

    return types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                       model_input_spans=swap(d.model_input_spans), loss_fn_input_spans=swap(d.loss_fn_input_spans))


def refused(trainer: Any, data: list[types.Datum], *needles: str, loss: str = "stable_reinforce") -> str:
    with pytest.raises(Exception) as caught:
        trainer.forward_backward(data, loss).result(timeout=120)
    message = str(caught.value)
    assert all(n in message for n in needles), message
    return message


def test_recorded_sequences_train_with_stable_reinforce(trainer: Any, recorded: list[types.SampledSequence]) -> None:
    assert len({s.sequence_id for s in recorded}) == 2
    result = trainer.forward_backward([datum(s) for s in recorded], "stable_reinforce").result(timeout=120)
    assert len(result.loss_fn_outputs) == 2
    assert all(v == v and abs(v) < float("inf") for v in result.metrics.values()), result.metrics


def test_sampler_logprobs_other_than_the_recorded_ones_are_refused(trainer: Any,
                                                                  recorded: list[types.SampledSequence]) -> None:
    """The sampler-side logprobs stable_reinforce reads must be what the server recorded for the sampled tokens
    (within 1e-4): one nudged by 0.01 is a user error naming the datum, the position and both values."""
    seq = recorded[0]
    good = datum(seq)
    nudged = list(good.loss_fn_inputs["logprobs"].tolist())
    position = len(PROMPT) - 1 + 2  # the third sampled token
    nudged[position] += 0.01
    bad = types.Datum(model_input=good.model_input,
                      loss_fn_inputs={**good.loss_fn_inputs, "logprobs": types.TensorData.from_numpy(
                          np.asarray(nudged, dtype=np.float32))},
                      model_input_spans=good.model_input_spans, loss_fn_input_spans=good.loss_fn_input_spans)
    refused(trainer, [good, bad], "datum 1 loss_fn_input_spans", seq.sequence_id, f"position {position}",
            "the server recorded")


def test_a_span_naming_an_unknown_sequence_is_a_user_error_naming_it(trainer: Any,
                                                                      recorded: list[types.SampledSequence]) -> None:
    unknown = recorded[0].sequence_id.rsplit(":", 1)[0] + ":9"  # the request's third sample: there were two
    refused(trainer, [renamed(datum(recorded[0]), unknown)], repr(unknown), "unknown")
    refused(trainer, [renamed(datum(recorded[0]), "nobody:sample:0:0:0")], "'nobody:sample:0:0:0'", "unknown")


def test_tokens_other_than_the_sequences_are_refused(trainer: Any, recorded: list[types.SampledSequence]) -> None:
    seq = recorded[0]
    changed = [(t + 1) % 2000 for t in seq.tokens]
    refused(trainer, [datum(seq, changed)], repr(seq.sequence_id), "where the sequence")
    longer = datum(seq, list(seq.tokens) + [7])  # one position past the sampled tokens
    refused(trainer, [longer], repr(seq.sequence_id), "positions")


def test_a_sequence_sampled_without_recording_is_refused_for_stable_reinforce_only(
        service_client: Any, trainer: Any) -> None:
    plain = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    seq = plain.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result(timeout=120).sequences[0]
    refused(trainer, [datum(seq)], repr(seq.sequence_id), "record_stability_info")
    # importance_sampling reads no record: the spans are provenance only
    assert trainer.forward_backward([datum(seq)], "importance_sampling").result(timeout=120).loss_fn_outputs


def test_spans_that_do_not_tile_the_field_are_refused_for_every_loss(trainer: Any,
                                                                     recorded: list[types.SampledSequence]) -> None:
    good = datum(recorded[0])
    short = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs,
                        model_input_spans=good.model_input_spans[:1], loss_fn_input_spans=good.loss_fn_input_spans)
    refused(trainer, [short], "model_input_spans", "tile", loss="importance_sampling")


def test_an_expired_record_is_a_user_error_naming_it(server_url: Any, trainer: Any,
                                                    recorded: list[types.SampledSequence]) -> None:
    database = Path(server_url.log_path).parent / "skyrl_tx.db"
    if not database.exists():
        pytest.skip("the expiry is moved back in the SQLite file; the PostgreSQL run shares the code path")
    seq = recorded[1]
    trainer.forward_backward([datum(seq)], "stable_reinforce").result(timeout=120)  # a use: now + a day
    request_id = seq.sequence_id.rsplit(":", 1)[0]
    engine = sa.create_engine(f"sqlite:///{database}")
    with engine.begin() as db:  # a day and a minute since that use
        long_ago = datetime.now(timezone.utc) - timedelta(days=1, minutes=1)
        updated = db.execute(sa.text("UPDATE stability_uses SET last_used_at = :t WHERE request_id = :r"),
                             {"t": long_ago.isoformat(sep=" "), "r": request_id}).rowcount
    engine.dispose()
    assert updated == 1
    refused(trainer, [datum(seq)], repr(seq.sequence_id), "expired")


def test_recorded_sequences_belong_to_the_session_that_sampled_them(tinker_env: Any,
                                                                    recorded: list[types.SampledSequence]) -> None:
    """Another session (same key) cannot train on this session's records: to it they are unknown."""
    with tinker.ServiceClient() as other:
        stranger = other.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
        refused(stranger, [datum(recorded[0])], repr(recorded[0].sequence_id), "unknown")
