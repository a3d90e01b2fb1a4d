"""The wire schema (skyrl_tx/wire) field by field, and the responses we encode, against the tinker 0.38 SDK's own
generated module and decoders (the request codec's edge cases: test_protobuf_codec.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.unknown_fields import UnknownFieldSet
from tinker.proto import response_conv
from tinker.proto import tinker_public_pb2 as public_pb

from decoded_datums import plain
from skyrl_tx.wire import tinker_wire_pb2 as our_pb
from skyrl_tx.wire.codec import (
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

F32 = public_pb.DTYPE_FLOAT32


def _descriptor_bytes(module: Any, package: str) -> bytes:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    proto.ClearField("name")
    proto.ClearField("package")
    return proto.SerializeToString().replace(f".{package}.".encode(), b".PKG.")


def test_schema_is_the_sdks_but_for_the_package() -> None:
    # Same messages, enums, field names, numbers, types, labels, oneofs, maps and presence, in the same order.
    assert _descriptor_bytes(our_pb, "skyrl_tx.wire") == _descriptor_bytes(public_pb, "tinker_public")
    assert our_pb.DESCRIPTOR.package != public_pb.DESCRIPTOR.package  # both modules live in one process


SCALARS = {FD.TYPE_DOUBLE: -2.5, FD.TYPE_FLOAT: 0.75, FD.TYPE_INT64: -(2**40), FD.TYPE_UINT64: 2**63 + 5,
           FD.TYPE_INT32: -7, FD.TYPE_UINT32: 2**31 + 1, FD.TYPE_BOOL: True, FD.TYPE_STRING: "naïve ✓",
           FD.TYPE_BYTES: b"\x00\xffbytes", FD.TYPE_ENUM: 1}


def _set_field(msg: Any, field: Any, depth: int) -> None:
    """Sets one field of `msg` to a non-default value (two entries for maps and repeated fields)."""
    value = getattr(msg, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        for key in ("k1", "k2"):
            if value_field.message_type is not None:
                _fill(value[key], depth + 1)
            else:
                value[key] = SCALARS[value_field.type]
    elif field.message_type is not None:
        for _ in range(2 if field.is_repeated else 1):
            _fill(value.add() if field.is_repeated else value, depth + 1)
    elif field.is_repeated:
        value.extend([SCALARS[field.type]] * 2)
    else:
        setattr(msg, field.name, SCALARS[field.type])


def _fill(msg: Any, depth: int = 0, member: str | None = None) -> Any:
    """Sets every field of `msg`; of each real oneof only `member` (default: its first field)."""
    if depth > 4:
        return msg
    for field in msg.DESCRIPTOR.fields:
        oneof = field.containing_oneof
        if oneof is not None and not oneof.name.startswith("_"):  # "_x": proto3 `optional`, always set
            names = [f.name for f in oneof.fields]
            if field.name != (member if member in names else names[0]):
                continue
        _set_field(msg, field, depth)
    return msg


def _variants(cls: Any) -> list[Any]:
    """One filled message per member of the message's real oneofs, so every field is on the wire in some variant."""
    members = [f.name for o in cls.DESCRIPTOR.oneofs if not o.name.startswith("_") for f in o.fields]
    return [_fill(cls(), member=m) for m in members or [None]]


MESSAGE_NAMES = sorted(public_pb.DESCRIPTOR.message_types_by_name)


@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_every_field_round_trips_sdk_to_ours_and_back(name: str) -> None:
    sdk_cls, our_cls = getattr(public_pb, name), getattr(our_pb, name)
    for sdk_msg in _variants(sdk_cls):
        wire = sdk_msg.SerializeToString()
        ours = our_cls.FromString(wire)
        assert len(UnknownFieldSet(ours)) == 0  # every field the SDK wrote is a known field of ours
        assert sdk_cls.FromString(ours.SerializeToString()) == sdk_msg
        # Field by field, through the text form (same names, same values).
        assert str(ours) == str(sdk_msg)


@pytest.mark.parametrize("name", MESSAGE_NAMES)
def test_every_field_round_trips_ours_to_sdk_and_back(name: str) -> None:
    for sdk_msg in _variants(getattr(public_pb, name)):
        ours = getattr(our_pb, name).FromString(sdk_msg.SerializeToString())
        theirs = getattr(public_pb, name).FromString(ours.SerializeToString())
        assert len(UnknownFieldSet(theirs)) == 0
        assert getattr(our_pb, name).FromString(theirs.SerializeToString()) == ours


def test_forward_backward_body_of_every_field_decodes() -> None:
    # A body the SDK module wrote with everything a forward_backward may carry; the codec reads its datums.
    msg = public_pb.ForwardBackwardRequest(model_id="m", seq_id=3, loss_fn="ppo", forward_only=True)
    msg.loss_fn_config["clip"] = 0.2
    msg.loss_fn_config_v2["clip"].number = 0.2
    msg.loss_fn_config_v2["mode"].text = "x"
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], np.int32).tobytes()
    t = datum.loss_fn_inputs["w"]
    t.dense, t.dtype = np.array([0.5, 1.5], np.float32).tobytes(), public_pb.DTYPE_FLOAT32
    t.shape.append(2)
    datum.model_input_spans.add().prompt_tokens.sequence_id = "p"
    datum.loss_fn_input_spans.add().sampled_tokens.length = 2
    got = decode_forward_backward_request(msg.SerializeToString(), None)
    assert (got["model_id"], got["seq_id"], got["loss_fn"], got["forward_only"]) == ("m", 3, "ppo", True)
    assert got["loss_fn_config"] == {"clip": 0.2, "mode": "x"}
    assert plain(got["data"]) == [{"input_tokens": [1, 2],
                                   "loss_fn_inputs": {"w": {"dtype": "float32", "shape": [2], "values": [0.5, 1.5]}}}]
    assert got["body"] == msg.SerializeToString()


# --------------------------------------------------------------------------------------------------
# Responses, read back through tinker/proto/response_conv.py
# --------------------------------------------------------------------------------------------------


def test_forward_backward_output_through_sdk() -> None:
    outputs = [
        {"logprobs": [-0.5, -1.25, -2.0], "elementwise_loss": [0.5, 1.25, 2.0]},
        {"logprobs": [], "elementwise_loss": []},
        {"elementwise_loss": [3.0], "logprobs": [-3.0]},
    ]
    metrics = {"loss:sum": 10.0, "tokens:sum": 4.0, "zero:mean": 0.0}
    body = encode_forward_backward_output(outputs, metrics)
    result = response_conv.deserialize_forward_backward_output(body)
    assert result.loss_fn_output_type == "ArrayRecord"
    assert result.metrics == metrics
    assert len(result.loss_fn_outputs) == 3
    for ours, theirs in zip(outputs, result.loss_fn_outputs, strict=True):
        assert set(theirs) == {"logprobs", "elementwise_loss"}
        for name, values in ours.items():
            assert theirs[name].dtype == "float32"
            assert theirs[name].shape == [len(values)]
            assert theirs[name].tolist() == values
    # Same message as the generated classes build (maps compare as maps, so field order is free).
    record = public_pb.ArrayRecord(num_datums=3)
    for name in ("logprobs", "elementwise_loss"):
        arrays = [np.asarray(o[name], dtype=np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(
            public_pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=F32)
        )
    expected = public_pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics)
    assert public_pb.ForwardBackwardOutput.FromString(body) == expected


def test_forward_backward_output_edge_cases() -> None:
    result = response_conv.deserialize_forward_backward_output(encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert result.loss_fn_outputs == [] and result.metrics == {"loss:sum": 0.0}
    body = encode_forward_backward_output([{"logprobs": [1.0]}], {}, output_type="tinker.losses:TorchLossReturn")
    result = response_conv.deserialize_forward_backward_output(body)
    assert result.loss_fn_output_type == "TorchLossReturn" and result.loss_fn_outputs[0]["logprobs"].tolist() == [1.0]
    with pytest.raises(ValueError):
        encode_forward_backward_output([{"logprobs": [1.0]}, {"elementwise_loss": [1.0]}], {})


def test_sample_response_through_sdk() -> None:
    sequences = [
        {"tokens": [5, 6, 7], "logprobs": [-0.5, -0.25, -1.0], "stop_reason": "stop"},
        {"tokens": [8, 2**31 - 1], "logprobs": None, "stop_reason": "length"},
        {"tokens": [], "logprobs": [], "stop_reason": "length"},
    ]
    prompt_logprobs = [None, -1.5, -0.125]
    topk = [None, [(5, -0.5), (9, -2.0)], [(3, -0.25)]]
    body = encode_sample_response(sequences, prompt_logprobs, topk)
    result = response_conv.deserialize_sample_response(body)
    assert [s.tokens for s in result.sequences] == [[5, 6, 7], [8, 2**31 - 1], []]
    assert [s.logprobs for s in result.sequences] == [[-0.5, -0.25, -1.0], None, None]
    assert [s.stop_reason for s in result.sequences] == ["stop", "length", "length"]
    assert result.prompt_logprobs == [None, -1.5, -0.125]
    assert result.topk_prompt_logprobs == [None, [(5, -0.5), (9, -2.0)], [(3, -0.25)]]
    assert result.prompt_cache_hit_tokens == 0
    assert result.target_prompt_logprobs is None and result.prompt_alt_tokens is None
    # Byte-identical to the generated classes (no maps here, so the serialization is canonical).
    nan_first = np.array([math.nan, -1.5, -0.125], dtype=np.float32)
    expected = public_pb.SampleResponse(
        sequences=[
            public_pb.SampledSequence(tokens=np.array([5, 6, 7], np.int32).tobytes(), logprobs=np.array([-0.5, -0.25, -1.0], np.float32).tobytes()),
            public_pb.SampledSequence(stop_reason=public_pb.STOP_REASON_LENGTH, tokens=np.array([8, 2**31 - 1], np.int32).tobytes()),
            public_pb.SampledSequence(stop_reason=public_pb.STOP_REASON_LENGTH, logprobs=b""),
        ],
        prompt_logprobs=nan_first.tobytes(),
        topk_prompt_logprobs=public_pb.TopkLogprobs(
            token_ids=np.array([0, 0, 5, 9, 3, 0], np.int32).tobytes(),
            logprobs=np.array([-99999.0, -99999.0, -0.5, -2.0, -0.25, -99999.0], np.float32).tobytes(),
            k=2,
            length=3,
        ),
    )
    assert body == expected.SerializeToString()


def test_sample_response_minimal_and_errors() -> None:
    result = response_conv.deserialize_sample_response(encode_sample_response([{"tokens": [1], "stop_reason": "stop"}]))
    assert result.sequences[0].tokens == [1] and result.sequences[0].logprobs is None
    assert result.prompt_logprobs is None and result.topk_prompt_logprobs is None
    with pytest.raises(ValueError, match="stop_reason"):
        encode_sample_response([{"tokens": [1], "stop_reason": "eos"}])
    with pytest.raises(ValueError):
        encode_sample_response([{"tokens": [2**31], "stop_reason": "stop"}])
