"""The wire schema and codec (skyrl_tx/wire) against the tinker 0.38 SDK's own generated module, encoder and decoders."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from tinker.proto import request_conv
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.types import (
    Datum,
    DmelChunk,
    EncodedTextChunk,
    ForwardBackwardInput,
    ForwardBackwardRequest,
    ImageChunk,
    ModelInput,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
)

from decoded_datums import plain
from skyrl_tx.wire import codec
from skyrl_tx.wire.codec import decode_forward_backward_request


def sdk_body(
    data: list[Datum],
    loss_fn: str = "cross_entropy",
    loss_fn_config: dict[str, float | str] | None = None,
    forward_only: bool = False,
    compress: bool = False,
    seq_id: int = 7,
) -> bytes:
    """Exactly what tinker/resources/training.py::forward_backward puts on the wire."""
    request = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config),
        model_id="sess:train:0",
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    body = msg.SerializeToString()
    return zstandard.ZstdCompressor().compress(body) if compress else body


def expected_datum(datum: Datum) -> dict[str, Any]:
    """The SDK's own view of a datum, through its public accessors (sparse CSR densified with 0)."""
    inputs = {}
    for name, td in datum.loss_fn_inputs.items():
        dense = td.to_numpy()
        inputs[name] = {"dtype": td.dtype, "shape": list(dense.shape), "values": dense.ravel().tolist()}
    return {"input_tokens": datum.model_input.to_ints(), "loss_fn_inputs": inputs}


def make_datums() -> list[Datum]:
    weights_2d = torch.zeros(4, 6)
    weights_2d[1, 2], weights_2d[3, 5] = 0.5, -1.25
    return [
        Datum(
            model_input=ModelInput.from_ints([1, 2, 3, 2**31 - 1]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 0.0, 0.5, 1.0]},
        ),
        Datum(
            model_input=ModelInput(chunks=[EncodedTextChunk(tokens=[10, 11]), EncodedTextChunk(tokens=[12])]),
            loss_fn_inputs={
                "target_tokens": np.array([11, 12, -3], dtype=np.int32),
                "weights": np.array([0.25, 0.75, 1.0], dtype=np.float64),
                "advantages": torch.tensor([1.5, -2.0, 0.0]),
                "logprobs": torch.tensor([-0.1, -0.2, -0.3], dtype=torch.bfloat16),
                "mask": torch.tensor([1, 0, 1], dtype=torch.int64),
            },
        ),
        Datum(
            model_input=ModelInput.from_ints(list(range(4))),
            loss_fn_inputs={"target_tokens": torch.tensor([[5, 0, 0, 0, 0, 0]] * 4), "weights": weights_2d},
        ),
    ]


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("forward_only", [False, True])
def test_request_round_trip(compress: bool, forward_only: bool) -> None:
    datums = make_datums()
    assert datums[2].loss_fn_inputs["weights"].sparse_crow_indices is not None  # really sent as CSR
    body = sdk_body(datums, loss_fn="ppo", forward_only=forward_only, compress=compress)
    got = decode_forward_backward_request(body, "zstd" if compress else None)
    assert got["model_id"] == "sess:train:0"
    assert got["seq_id"] == 7
    assert got["loss_fn"] == "ppo"
    assert got["forward_only"] is forward_only
    assert got["loss_fn_config"] == {}
    assert plain(got["data"]) == [expected_datum(d) for d in datums]
    weights = plain(got["data"])[2]["loss_fn_inputs"]["weights"]
    assert weights["shape"] == [4, 6] and weights["values"][1 * 6 + 2] == 0.5 and weights["values"][23] == -1.25


def test_request_loss_fn_config_float_and_string() -> None:
    body = sdk_body(make_datums()[:1], loss_fn_config={"clip_low_threshold": 0.8, "mode": "x", "n": 3})
    got = decode_forward_backward_request(body, None)
    assert got["loss_fn_config"] == {"clip_low_threshold": 0.8, "mode": "x", "n": 3.0}
    assert isinstance(got["loss_fn_config"]["n"], float)
    # Legacy-only senders (numbers in field 5, nothing in field 7) still work.
    legacy = public_pb.ForwardBackwardRequest(model_id="m", loss_fn_config={"a": 0.5, "b": 0.0})
    assert decode_forward_backward_request(legacy.SerializeToString(), "")["loss_fn_config"] == {"a": 0.5, "b": 0.0}


def test_request_defaults_and_empty() -> None:
    got = decode_forward_backward_request(b"", None)
    assert got == {"model_id": "", "seq_id": 0, "loss_fn": "", "forward_only": False, "loss_fn_config": {}, "data": [],
                   "body": b""}
    body = sdk_body([Datum(model_input=ModelInput.from_ints([]), loss_fn_inputs={"weights": []})])
    datum = plain(decode_forward_backward_request(body, None)["data"])[0]
    assert datum == {"input_tokens": [], "loss_fn_inputs": {"weights": {"dtype": "float32", "shape": [0], "values": []}}}


def test_request_provenance_spans_are_skipped() -> None:
    datum = Datum(model_input=ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    datum = datum.with_provenance(
        model_input=[PromptProvenanceSpan(sequence_id="s0", length=2), SampledProvenanceSpan(sequence_id="s1", length=1)],
        loss_fn_inputs=[SampledProvenanceSpan(sequence_id="s1", offset=0, length=3)],
    )
    assert plain(decode_forward_backward_request(sdk_body([datum]), None)["data"]) == [expected_datum(datum)]


def test_request_int32_and_bfloat16_tensors() -> None:
    # The 0.38 SDK only writes FLOAT32/INT64, but the schema allows INT32 and BFLOAT16.
    bf16 = torch.tensor([1.5, -0.375, 3.0e10], dtype=torch.bfloat16)
    datum = public_pb.Datum(
        model_input=[public_pb.Chunk(encoded_text=public_pb.EncodedTextChunk(tokens=struct.pack("<2i", 4, 5)))],
        loss_fn_inputs={
            "ids": public_pb.Tensor(dense=struct.pack("<3i", 1, -2, 3), dtype=public_pb.DTYPE_INT32, shape=[3]),
            "w": public_pb.Tensor(dense=bf16.view(torch.int16).numpy().tobytes(), dtype=public_pb.DTYPE_BFLOAT16, shape=[3]),
            "noshape": public_pb.Tensor(dense=struct.pack("<2f", 1.0, 2.0), dtype=public_pb.DTYPE_FLOAT32),
        },
    )
    body = public_pb.ForwardBackwardRequest(model_id="m", seq_id=-5, data=[datum]).SerializeToString()
    got = decode_forward_backward_request(body, None)
    assert got["seq_id"] == -5
    inputs = plain(got["data"])[0]["loss_fn_inputs"]
    assert got["data"][0]["input_tokens"].tolist() == [4, 5]
    assert inputs["ids"] == {"dtype": "int64", "shape": [3], "values": [1, -2, 3]}
    assert inputs["w"] == {"dtype": "float32", "shape": [3], "values": bf16.float().tolist()}
    assert inputs["noshape"] == {"dtype": "float32", "shape": [2], "values": [1.0, 2.0]}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _field(number: int, wt: int, payload: bytes) -> bytes:
    """One field on the wire, built independently of the codec under test."""
    return _varint(number << 3 | wt) + (_varint(len(payload)) + payload if wt == 2 else payload)


UNKNOWN = (
    _field(90, 0, _varint(2**64 - 1))
    + _field(91, 1, b"\x01" * 8)
    + _field(92, 2, b"anything")
    + _field(93, 3, _field(1, 0, b"\x05") + _field(94, 3, b"") + _varint(94 << 3 | 4))
    + _varint(93 << 3 | 4)
    + _field(95, 5, b"\x02" * 4)
)


def test_request_skips_unknown_fields_of_every_wire_type() -> None:
    datum = make_datums()[1]
    datum_msg = request_conv.forward_backward_request_to_proto(
        ForwardBackwardRequest(ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id="m", seq_id=1)
    ).data[0]
    # Unknown fields inside a Datum, inside a Tensor, and at the top level (before and after).
    tensor = datum_msg.loss_fn_inputs["weights"].SerializeToString() + UNKNOWN
    entry = _field(1, 2, b"weights") + _field(2, 2, tensor)
    datum_bytes = UNKNOWN + datum_msg.SerializeToString() + _field(2, 2, entry) + UNKNOWN
    body = UNKNOWN + _field(1, 2, b"m") + _field(3, 2, datum_bytes) + UNKNOWN
    public_pb.ForwardBackwardRequest.FromString(body)  # the real parser accepts it too
    got = decode_forward_backward_request(body, None)
    assert got["model_id"] == "m" and plain(got["data"]) == [expected_datum(datum)]


@pytest.mark.parametrize(
    ("chunk", "kind"),
    [(ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4), "image"), (DmelChunk(dmel=b"\x00\x01"), "dmel")],
)
def test_request_non_text_chunk_rejected(chunk: Any, kind: str) -> None:
    datum = Datum(model_input=ModelInput(chunks=[EncodedTextChunk(tokens=[1]), chunk]), loss_fn_inputs={})
    with pytest.raises(ValueError, match=f"^model_input chunk type '{kind}': only encoded_text chunks are supported"):
        decode_forward_backward_request(sdk_body([datum]), None)


def test_request_oversized_zstd(monkeypatch: pytest.MonkeyPatch) -> None:
    body = sdk_body(make_datums())
    monkeypatch.setattr(codec, "MAX_DECOMPRESSED_BYTES", len(body) - 1)
    with pytest.raises(ValueError, match="exceeds"):
        decode_forward_backward_request(zstandard.ZstdCompressor().compress(body), "zstd")
    with pytest.raises(ValueError, match="exceeds"):
        decode_forward_backward_request(body, None)
    monkeypatch.setattr(codec, "MAX_DECOMPRESSED_BYTES", len(body))
    assert len(decode_forward_backward_request(zstandard.ZstdCompressor().compress(body), "zstd")["data"]) == 3


def test_request_zstd_bomb_stops_early(monkeypatch: pytest.MonkeyPatch) -> None:
    # 256 MiB of zeros in a frame without a content size; with a 1 MiB cap we must bail out early.
    monkeypatch.setattr(codec, "MAX_DECOMPRESSED_BYTES", 1 << 20)
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    zero = bytes(1 << 20)
    bomb = b"".join(cobj.compress(zero) for _ in range(256)) + cobj.flush()
    with pytest.raises(ValueError, match="exceeds"):
        decode_forward_backward_request(bomb, "zstd")


def test_request_multi_frame_zstd() -> None:
    body = sdk_body(make_datums())
    half = len(body) // 2
    frames = zstandard.ZstdCompressor().compress(body[:half]) + zstandard.ZstdCompressor().compress(body[half:])
    assert plain(decode_forward_backward_request(frames, " ZSTD ")["data"]) == [expected_datum(d) for d in make_datums()]


def _tensor_body(tensor: public_pb.Tensor) -> bytes:
    return public_pb.ForwardBackwardRequest(data=[public_pb.Datum(loss_fn_inputs={"t": tensor})]).SerializeToString()


F32 = public_pb.DTYPE_FLOAT32
MALFORMED = {
    "truncated_message": sdk_body(make_datums())[:-3],
    "varint_too_long": b"\x10" + b"\xff" * 10 + b"\x01",
    "truncated_varint": b"\x10\xff",
    "wire_type_7": b"\x0f",
    "wire_type_6": b"\x0e",
    "field_zero": b"\x00\x00",
    "stray_end_group": b"\x0c",
    "unterminated_group": b"\x0b\x08\x01",
    "mismatched_end_group": b"\x0b\x14",
    "deeply_nested_groups": b"\x0b" * 100,
    "bad_utf8": _field(1, 2, b"\xff\xfe"),
    "length_past_end": b"\x0a\x05ab",
    "odd_token_bytes": _field(3, 2, _field(1, 2, _field(1, 2, _field(1, 2, b"\x01\x02\x03")))),
    "empty_chunk": _field(3, 2, _field(1, 2, b"")),
    "dtype_unspecified": _tensor_body(public_pb.Tensor(dense=b"\x00" * 4, shape=[1])),
    "dense_size_mismatch": _tensor_body(public_pb.Tensor(dense=b"\x00" * 8, dtype=F32, shape=[3])),
    "dense_partial_item": _tensor_body(public_pb.Tensor(dense=b"\x00" * 6, dtype=F32, shape=[1])),
    "csr_not_2d": _tensor_body(
        public_pb.Tensor(sparse_csr=public_pb.SparseCsr(values=b"", crow_indices=struct.pack("<q", 0)), dtype=F32, shape=[3])
    ),
    "csr_col_out_of_range": _tensor_body(
        public_pb.Tensor(
            sparse_csr=public_pb.SparseCsr(
                values=struct.pack("<f", 1.0), crow_indices=struct.pack("<2q", 0, 1), col_indices=struct.pack("<q", 5)
            ),
            dtype=F32,
            shape=[1, 3],
        )
    ),
    "csr_bad_row_pointers": _tensor_body(
        public_pb.Tensor(
            sparse_csr=public_pb.SparseCsr(
                values=struct.pack("<2f", 1.0, 2.0),
                crow_indices=struct.pack("<3q", 0, 2, 2)[:8] + struct.pack("<2q", 3, 2),
                col_indices=struct.pack("<2q", 0, 1),
            ),
            dtype=F32,
            shape=[2, 3],
        )
    ),
    "csr_huge_shape": _tensor_body(
        public_pb.Tensor(
            sparse_csr=public_pb.SparseCsr(values=b"", crow_indices=struct.pack("<2q", 0, 0)), dtype=F32, shape=[1, 2**40]
        )
    ),
    "v2_without_value": public_pb.ForwardBackwardRequest(
        loss_fn_config_v2={"k": public_pb.LossConfigValue()}
    ).SerializeToString(),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_request_malformed_raises_value_error(name: str) -> None:
    with pytest.raises(ValueError):
        decode_forward_backward_request(MALFORMED[name], None)


@pytest.mark.parametrize("body", [b"\x08\x01", _field(2, 2, b"x")], ids=["model_id_as_varint", "seq_id_as_bytes"])
def test_request_known_field_with_wrong_wire_type_is_an_unknown_field(body: bytes) -> None:
    # Protobuf parsers keep a known field number with another wire type as an unknown field: ours as the SDK's.
    sdk = public_pb.ForwardBackwardRequest.FromString(body)
    got = decode_forward_backward_request(body, None)
    assert (got["model_id"], got["seq_id"]) == (sdk.model_id, sdk.seq_id) == ("", 0)


@pytest.mark.parametrize(
    ("body", "encoding"),
    [(b"not zstd at all", "zstd"), (zstandard.ZstdCompressor().compress(b"\x0a\x01m" * 100)[:-4], "zstd"), (b"", "zstd"),
     (zstandard.ZstdCompressor().compress(b"\x0a\x01m") + b"junk", "zstd"), (b"\x0a\x01m", "gzip")],
)
def test_request_bad_encoding_raises_value_error(body: bytes, encoding: str) -> None:
    with pytest.raises(ValueError):
        decode_forward_backward_request(body, encoding)


# --------------------------------------------------------------------------------------------------
# The schema: the project's generated module against the SDK's, message by message and field by field
# --------------------------------------------------------------------------------------------------
