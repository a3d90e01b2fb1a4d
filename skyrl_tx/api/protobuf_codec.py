"""Hand-written protobuf wire codec for the Tinker `tinker_public` messages (SDK 0.38) the server speaks."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_DECOMPRESSED_BYTES", "decode_forward_backward_request", "encode_forward_backward_output",
           "encode_sample_response"]

# A request body (after zstd) may not exceed this; it also bounds how far a sparse tensor may densify.
MAX_DECOMPRESSED_BYTES = 1 << 30
# Compressed bytes fed to zstd per step: zstd can expand ~32768x (RLE blocks), so small steps keep the
# overshoot past MAX_DECOMPRESSED_BYTES to ~32 MiB before we notice and stop.
_ZSTD_FEED = 1024

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_U64 = 1 << 64

# DType enum -> (public dtype name, struct code, item size). INT32 widens to int64 and BFLOAT16 to
# float32, exactly as the SDK's own response decoder collapses them.
_DTYPES: dict[int, tuple[str, str, int]] = {
    1: ("float32", "f", 4),  # DTYPE_FLOAT32
    2: ("int64", "q", 8),  # DTYPE_INT64
    3: ("int64", "i", 4),  # DTYPE_INT32
    4: ("float32", "H", 2),  # DTYPE_BFLOAT16 (raw upper half of a float32)
}
_DTYPE_FLOAT32 = 1
_PACKED = 8 | _VARINT  # schema marker: a repeated int64 that may arrive packed (LEN) or one per tag

# Field number -> (name, wire type) for the request messages; unlisted numbers are skipped, e.g.
# Datum 3/4 (provenance spans), which this server does not use.
_REQUEST = {1: ("model_id", _LEN), 2: ("seq_id", _VARINT), 3: ("data", _LEN), 4: ("loss_fn", _LEN),
            5: ("loss_fn_config", _LEN), 6: ("forward_only", _VARINT), 7: ("loss_fn_config_v2", _LEN)}
_DATUM = {1: ("model_input", _LEN), 2: ("loss_fn_inputs", _LEN)}
_CHUNK = {1: ("encoded_text", _LEN), 2: ("image", _LEN), 3: ("dmel", _LEN)}
_TENSOR = {1: ("dense", _LEN), 2: ("sparse_csr", _LEN), 3: ("dtype", _VARINT), 4: ("shape", _PACKED)}
_CSR = {1: ("values", _LEN), 2: ("crow_indices", _LEN), 3: ("col_indices", _LEN)}
_STOP_REASONS = {"stop": 0, "length": 1}
_TOPK_SENTINEL = (0, -99999.0)  # types/topk_logprobs.py: a cell the SDK treats as "empty"


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    for _ in range(10):  # a 64-bit varint never needs more than 10 bytes
        if pos >= len(buf):
            raise ValueError("truncated protobuf varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & (_U64 - 1), pos
        shift += 7
    raise ValueError("protobuf varint longer than 10 bytes")


def _read_field(buf: memoryview, pos: int, depth: int = 0) -> tuple[int, int, Any, int]:
    """Read one field at `pos`: (number, wire type, value, next pos). The value is an int for varints,
    a memoryview for LEN/I64/I32, None for groups (skipped whole, nested ones included)."""
    key, pos = _read_varint(buf, pos)
    field, wt = key >> 3, key & 7
    if field == 0:
        raise ValueError("protobuf field number 0 is invalid")
    if wt == _VARINT:
        value, pos = _read_varint(buf, pos)
        return field, wt, value, pos
    if wt == _SGROUP:  # deprecated groups are never in this schema: skip to the matching end tag
        if depth > 64:  # bounded, so hostile nesting cannot reach Python's recursion limit
            raise ValueError("protobuf groups nested too deeply")
        while True:
            if pos >= len(buf):
                raise ValueError("truncated protobuf group")
            f, w, _, pos = _read_field(buf, pos, depth + 1)
            if w == _EGROUP:
                if f != field:
                    raise ValueError("mismatched protobuf end-group tag")
                return field, wt, None, pos
    if wt == _EGROUP:
        return field, wt, None, pos  # only legal inside a group; _parse rejects it elsewhere
    if wt == _LEN:
        size, pos = _read_varint(buf, pos)
    elif wt in (_I64, _I32):
        size = 8 if wt == _I64 else 4
    else:
        raise ValueError(f"invalid protobuf wire type {wt}")
    if size > len(buf) - pos:
        raise ValueError("protobuf field runs past the end of its message")
    return field, wt, buf[pos : pos + size], pos + size


def _parse(buf: memoryview, what: str, schema: dict[int, tuple[str, int]]) -> dict[str, list[Any]]:
    """Collect every occurrence of each known field under its name; unknown field numbers are skipped.
    A known field with the wrong wire type is a schema mismatch, so it fails loudly."""
    out: dict[str, list[Any]] = {name: [] for name, _ in schema.values()}
    pos = 0
    while pos < len(buf):
        field, wt, value, pos = _read_field(buf, pos)
        if wt == _EGROUP:
            raise ValueError("unexpected protobuf end-group tag")
        if field not in schema:
            continue
        name, expected = schema[field]
        if expected == _PACKED and wt in (_VARINT, _LEN):  # repeated int64: packed or not, both legal
            ints, p = [value] if wt == _VARINT else [], 0
            while wt == _LEN and p < len(value):
                v, p = _read_varint(value, p)
                ints.append(v)
            out[name].extend(v - _U64 if v >> 63 else v for v in ints)
        elif wt != expected:
            raise ValueError(f"{what}.{name}: wire type {wt}, expected {expected & 7}")
        else:
            out[name].append(value)
    return out


def _msg(pieces: list[memoryview]) -> memoryview:
    # A message field seen more than once merges, which on the wire means concatenating the pieces.
    return pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))


def _last(pieces: list[Any], default: Any) -> Any:
    return pieces[-1] if pieces else default  # proto3 scalars: the last occurrence wins


def _str(pieces: list[memoryview], what: str) -> str:
    try:
        return bytes(_last(pieces, b"")).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8") from exc


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF  # proto int32 keeps the low 32 bits of the (sign-extended) varint
    return v - (1 << 32) if v >= 1 << 31 else v


def _map(entries: list[memoryview], what: str, value_wt: int) -> dict[str, list[Any]]:
    # A map is a repeated entry message {key = 1; value = 2}; a later entry for a key replaces it.
    out: dict[str, list[Any]] = {}
    for entry in entries:
        e = _parse(entry, what, {1: ("key", _LEN), 2: ("value", value_wt)})
        out[_str(e["key"], f"{what} key")] = e["value"]
    return out


def _unpack(view: memoryview | bytes, code: str, size: int, what: str) -> list[Any]:
    if len(view) % size:
        raise ValueError(f"{what}: {len(view)} bytes is not a multiple of the {size}-byte item size")
    n = len(view) // size
    if code == "H":
        # bfloat16 is the top half of a little-endian float32: put its two bytes above two zero bytes.
        raw, wide = bytes(view), bytearray(4 * n)
        wide[2::4], wide[3::4] = raw[0::2], raw[1::2]
        return list(struct.unpack(f"<{n}f", wide))
    return list(struct.unpack(f"<{n}{code}", view))


def _decompress_zstd(body: bytes, limit: int) -> bytearray:
    import zstandard  # lazy: only zstd bodies need it (installed as a dependency of `tinker`)

    out = bytearray()
    data = memoryview(body)
    dctx = zstandard.ZstdDecompressor()
    try:
        while True:  # RFC 8878 allows several concatenated frames
            obj, pos = dctx.decompressobj(), 0
            while not obj.eof:
                if pos >= len(data):
                    raise ValueError("truncated zstd request body")
                out += obj.decompress(data[pos : pos + _ZSTD_FEED])
                pos += _ZSTD_FEED
                if len(out) > limit:
                    raise ValueError(f"decompressed request body exceeds {limit} bytes")
            data = memoryview(obj.unused_data + bytes(data[pos:]))
            if not data:
                return out  # a bytearray: avoids copying up to 1 GiB once more
    except zstandard.ZstdError as exc:
        raise ValueError(f"malformed zstd request body: {exc}") from exc


def _decode_tensor(buf: memoryview, what: str) -> dict[str, Any]:
    t = _parse(buf, what, _TENSOR)
    dtype_code = _int32(_last(t["dtype"], 0))
    if dtype_code not in _DTYPES:
        raise ValueError(f"{what}: unsupported tensor dtype enum {dtype_code}")
    dtype, code, size = _DTYPES[dtype_code]
    shape = t["shape"]
    if any(d < 0 for d in shape):
        raise ValueError(f"{what}: negative dimension in shape {shape}")
    if t["dense"] and t["sparse_csr"]:  # the SDK sets one member of the `encoding` oneof
        raise ValueError(f"{what}: both dense and sparse_csr are set")
    if t["sparse_csr"]:
        values = _densify_csr(_msg(t["sparse_csr"]), shape, code, size, what)
        return {"dtype": dtype, "shape": shape, "values": values}
    values = _unpack(_last(t["dense"], b""), code, size, what)
    if not shape:
        shape = [len(values)]  # like TensorData, a tensor sent without a shape is 1-D
    elif math.prod(shape) != len(values):
        raise ValueError(f"{what}: shape {shape} needs {math.prod(shape)} values, got {len(values)}")
    return {"dtype": dtype, "shape": shape, "values": values}


def _densify_csr(buf: memoryview, shape: list[int], code: str, size: int, what: str) -> list[Any]:
    csr = _parse(buf, what, _CSR)
    values = _unpack(_last(csr["values"], b""), code, size, what)
    crow = _unpack(_last(csr["crow_indices"], b""), "q", 8, what)
    col = _unpack(_last(csr["col_indices"], b""), "q", 8, what)
    # The SDK only makes CSR from 2-D tensors (TensorData.from_torch_sparse). Check everything: a
    # hostile body could otherwise index outside the matrix or ask for a huge one.
    if len(shape) != 2:
        raise ValueError(f"{what}: sparse CSR tensor needs a 2-D shape, got {shape}")
    rows, cols = shape
    if rows * cols * size > MAX_DECOMPRESSED_BYTES:
        raise ValueError(f"{what}: sparse tensor of shape {shape} is too large to densify")
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(values) or len(col) != len(values):
        raise ValueError(f"{what}: inconsistent sparse CSR indices for shape {shape}")
    dense: list[Any] = [0.0 if code in "fH" else 0] * (rows * cols)  # unlisted cells are 0 (pad_value=0)
    for r in range(rows):
        if not crow[r] <= crow[r + 1] <= len(values):
            raise ValueError(f"{what}: sparse CSR row pointers are not monotonic")
        for i in range(crow[r], crow[r + 1]):
            if not 0 <= col[i] < cols:
                raise ValueError(f"{what}: sparse CSR column index {col[i]} is out of range")
            dense[r * cols + col[i]] = values[i]
    return dense


def _decode_chunk(buf: memoryview) -> list[int]:
    chunk = _parse(buf, "model_input chunk", _CHUNK)
    for kind in ("image", "dmel"):
        if chunk[kind]:
            raise ValueError(f"model_input chunk type {kind!r} is not supported by this server")
    if not chunk["encoded_text"]:
        raise ValueError("model_input chunk has no content")
    tokens = _parse(_msg(chunk["encoded_text"]), "encoded_text", {1: ("tokens", _LEN)})["tokens"]
    return _unpack(_last(tokens, b""), "i", 4, "encoded_text.tokens")


def _decode_datum(buf: memoryview) -> dict[str, Any]:
    datum = _parse(buf, "datum", _DATUM)
    return {
        "input_tokens": [token for chunk in datum["model_input"] for token in _decode_chunk(chunk)],
        "loss_fn_inputs": {
            name: _decode_tensor(_msg(pieces), f"loss_fn_inputs[{name!r}]")
            for name, pieces in _map(datum["loss_fn_inputs"], "loss_fn_inputs", _LEN).items()
        },
    }


def decode_forward_backward_request(body: bytes, content_encoding: str | None) -> dict[str, Any]:
    """Decode a `POST /api/v1/forward_backward` body into plain Python values.

    Raises ValueError for an unsupported Content-Encoding, a malformed or oversized body, or a
    model_input chunk other than encoded text."""
    encoding = (content_encoding or "").strip().lower()
    raw: bytes | bytearray = body
    if encoding == "zstd":
        raw = _decompress_zstd(body, MAX_DECOMPRESSED_BYTES)
    elif encoding not in ("", "identity"):
        raise ValueError(f"unsupported Content-Encoding {content_encoding!r} (only zstd)")
    if len(raw) > MAX_DECOMPRESSED_BYTES:
        raise ValueError(f"request body exceeds {MAX_DECOMPRESSED_BYTES} bytes")
    req = _parse(memoryview(raw), "request", _REQUEST)
    legacy = {
        key: struct.unpack("<d", _last(v, bytes(8)))[0]
        for key, v in _map(req["loss_fn_config"], "loss_fn_config", _I64).items()
    }
    v2: dict[str, float | str] = {}
    for key, pieces in _map(req["loss_fn_config_v2"], "loss_fn_config_v2", _LEN).items():
        value = _parse(_msg(pieces), f"loss_fn_config_v2[{key!r}]", {1: ("number", _I64), 2: ("text", _LEN)})
        if bool(value["number"]) == bool(value["text"]):  # a oneof: exactly one member is expected
            raise ValueError(f"loss_fn_config_v2[{key!r}] must set exactly one of number and text")
        number, text = value["number"], value["text"]
        v2[key] = struct.unpack("<d", number[-1])[0] if number else _str(text, f"loss_fn_config_v2[{key!r}]")
    return {
        "model_id": _str(req["model_id"], "model_id"),
        "seq_id": _int32(_last(req["seq_id"], 0)),
        "loss_fn": _str(req["loss_fn"], "loss_fn"),
        "forward_only": bool(_last(req["forward_only"], 0)),
        # The SDK dual-writes numbers into both maps and strings only into v2, so v2 is the whole
        # config whenever it is non-empty; the legacy map serves clients that predate it.
        "loss_fn_config": v2 or legacy,
        "data": [_decode_datum(datum) for datum in req["data"]],
    }


def _varint(n: int) -> bytes:
    if n < 0:
        n += _U64  # negative int32/int64 use the 10-byte two's complement form
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int, wt: int) -> bytes:
    return _varint(field << 3 | wt)


def _len_field(field: int, payload: bytes | bytearray) -> bytes:
    return _tag(field, _LEN) + _varint(len(payload)) + bytes(payload)


def _opt_len_field(field: int, payload: bytes | bytearray) -> bytes:
    return _len_field(field, payload) if payload else b""  # proto3: an empty string/bytes is omitted


def _opt_varint_field(field: int, n: int) -> bytes:
    return _tag(field, _VARINT) + _varint(n) if n else b""  # proto3: zero is omitted


def _pack(code: str, values: Sequence[Any], what: str) -> bytes:
    try:
        return struct.pack(f"<{len(values)}{code}", *values)
    except (struct.error, OverflowError, TypeError) as exc:
        raise ValueError(f"{what}: cannot pack as {code!r}: {exc}") from exc


def encode_forward_backward_output(
    outputs: list[dict[str, list[float]]],
    metrics: dict[str, float],
    output_type: str = "ArrayRecord",
) -> bytes:
    """Encode a ForwardBackwardOutput: one ArrayRecord holding one float32 BatchedTensor per field
    (per-datum arrays concatenated, int64 byte offsets), plus the metrics map."""
    names: list[str] = []
    for datum in outputs:
        names.extend(k for k in datum if k not in names)
    for i, datum in enumerate(outputs):
        if set(datum) != set(names):
            raise ValueError(f"output {i} has fields {sorted(datum)}, expected {sorted(names)}")
    record = bytearray()
    # ArrayRecord.type_tag (1) is left unset: the SDK never reads it.
    for name in names:
        data = bytearray()
        offsets = [0]
        for datum in outputs:
            data += _pack("f", datum[name], f"output field {name!r}")
            offsets.append(len(data))  # byte offsets, num_datums + 1 of them
        tensor = (
            _opt_len_field(1, data)
            + _len_field(2, _pack("q", offsets, "offsets"))
            + _opt_varint_field(3, _DTYPE_FLOAT32)
            # trailing_shape (4) stays empty: every field is 1-D per datum.
        )
        record += _len_field(2, _len_field(1, name.encode("utf-8")) + _len_field(2, tensor))
    record += _opt_varint_field(3, len(outputs))
    msg = bytearray(_opt_len_field(1, output_type.encode("utf-8")))
    msg += _len_field(2, record)
    for key, value in metrics.items():  # map entries carry key and value always, as upb/C++ write them
        msg += _len_field(3, _len_field(1, key.encode("utf-8")) + _tag(2, _I64) + struct.pack("<d", float(value)))
    return bytes(msg)


def _encode_topk(rows: Sequence[Sequence[tuple[int, float]] | None]) -> bytes:
    # Dense length x k matrices; None rows and short rows are filled with the sentinel the SDK trims.
    k = max((len(r) for r in rows if r), default=0)
    cells = [cell for row in rows for cell in [*(row or []), *[_TOPK_SENTINEL] * (k - len(row or []))]]
    ids, lps = [c[0] for c in cells], [c[1] for c in cells]
    return (
        _opt_len_field(1, _pack("i", ids, "topk token_ids"))
        + _opt_len_field(2, _pack("f", lps, "topk logprobs"))
        + _opt_varint_field(3, k)
        + _opt_varint_field(4, len(rows))
    )


def encode_sample_response(
    sequences: list[dict[str, Any]],
    prompt_logprobs: list[float | None] | None = None,
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None,
) -> bytes:
    """Encode a SampleResponse. Each sequence is {"tokens", "logprobs" (or None), "stop_reason"}."""
    msg = bytearray()
    for i, seq in enumerate(sequences):
        reason = seq.get("stop_reason", "stop")
        if reason not in _STOP_REASONS:
            raise ValueError(f"sequence {i}: unknown stop_reason {reason!r}")
        body = _opt_varint_field(1, _STOP_REASONS[reason])  # STOP is 0, so it never hits the wire
        tokens = seq.get("tokens")
        body += _opt_len_field(2, _pack("i", [] if tokens is None else tokens, f"sequence {i} tokens"))
        logprobs = seq.get("logprobs")
        if logprobs is not None:  # `optional bytes`: presence is explicit, so even b"" is written
            body += _len_field(3, _pack("f", logprobs, f"sequence {i} logprobs"))
        msg += _len_field(1, body)
    if prompt_logprobs is not None:
        msg += _len_field(2, _pack("f", [math.nan if v is None else v for v in prompt_logprobs], "prompt_logprobs"))
    if topk_prompt_logprobs is not None:
        msg += _len_field(3, _encode_topk(topk_prompt_logprobs))
    return bytes(msg)
