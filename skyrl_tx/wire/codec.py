"""The protobuf wire codec: request bodies in, result bodies out, over the generated `tinker_wire_pb2` (numpy, no torch)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from skyrl_tx.wire import tinker_wire_pb2 as pb

__all__ = ["MAX_DECOMPRESSED_BYTES", "decode_forward_backward_request", "decode_forward_backward_output",
           "encode_forward_backward_output", "encode_sample_response"]

# A request body (after zstd) may not exceed this; it also bounds how far a sparse tensor may densify.
MAX_DECOMPRESSED_BYTES = 1 << 30
# Why a chunk that is not encoded text is refused, and what to send instead (sampling and training say the same).
TEXT_ONLY = ("only encoded_text chunks are supported: this server runs the text model only (a vision-language "
             "checkpoint such as Qwen3.5 is served without its vision tower); render images out of the prompt")
# Compressed bytes fed to zstd per step: zstd can expand ~32768x (RLE blocks), so small steps keep the
# overshoot past the limit to ~32 MiB before we notice and stop.
_ZSTD_FEED = 1024

# DType enum -> (public dtype name, little-endian source dtype). INT32 widens to int64 and BFLOAT16 to
# float32, exactly as the SDK's own response decoder collapses them.
_DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.DTYPE_FLOAT32: ("float32", np.dtype("<f4")),
    pb.DTYPE_INT64: ("int64", np.dtype("<i8")),
    pb.DTYPE_INT32: ("int64", np.dtype("<i4")),
    pb.DTYPE_BFLOAT16: ("float32", np.dtype("<u2")),  # raw upper half of a float32
}
_I32, _I64, _F32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_TOPK_SENTINEL = (0, -99999.0)  # types/topk_logprobs.py: a cell the SDK treats as "empty"


def _decompress_zstd(body: bytes, limit: int) -> bytearray:
    import zstandard  # lazy: only zstd bodies need it

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
                return out
    except zstandard.ZstdError as exc:
        raise ValueError(f"malformed zstd request body: {exc}") from exc


def _array(raw: bytes, source: np.dtype, what: str) -> np.ndarray:
    """A 1-D read-only view of little-endian bytes, widened to float32/int64 where the wire type is narrower."""
    if len(raw) % source.itemsize:
        raise ValueError(f"{what}: {len(raw)} bytes is not a multiple of the {source.itemsize}-byte item size")
    values = np.frombuffer(raw, dtype=source)
    if source == np.dtype("<i4"):
        return values.astype(np.int64)
    if source == np.dtype("<u2"):  # bfloat16: shift into the top half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values


def _decode_tensor(t: pb.Tensor, what: str, max_bytes: int) -> dict[str, Any]:
    if t.dtype not in _DTYPES:
        raise ValueError(f"{what}: unsupported tensor dtype enum {t.dtype}")
    dtype, source = _DTYPES[t.dtype]
    shape = list(t.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{what}: negative dimension in shape {shape}")
    if t.WhichOneof("encoding") == "sparse_csr":
        values = _densify_csr(t.sparse_csr, shape, source, what, max_bytes)
    else:
        values = _array(t.dense, source, what)
        if not shape:
            shape = [len(values)]  # like TensorData, a tensor sent without a shape is 1-D
        elif math.prod(shape) != len(values):
            raise ValueError(f"{what}: shape {shape} needs {math.prod(shape)} values, got {len(values)}")
    return {"dtype": dtype, "shape": shape, "values": values}  # values: 1-D, row-major, prod(shape) of them


def _densify_csr(csr: pb.SparseCsr, shape: list[int], source: np.dtype, what: str, max_bytes: int) -> np.ndarray:
    values = _array(csr.values, source, what)
    crow = _array(csr.crow_indices, _I64, what)
    col = _array(csr.col_indices, _I64, what)
    # The SDK only makes CSR from 2-D tensors (TensorData.from_torch_sparse). Check everything: a
    # hostile body could otherwise index outside the matrix or ask for a huge one.
    if len(shape) != 2:
        raise ValueError(f"{what}: sparse CSR tensor needs a 2-D shape, got {shape}")
    rows, cols = shape
    if rows * cols * values.dtype.itemsize > max_bytes:
        raise ValueError(f"{what}: sparse tensor of shape {shape} is too large to densify")
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(values) or len(col) != len(values):
        raise ValueError(f"{what}: inconsistent sparse CSR indices for shape {shape}")
    counts = np.diff(crow)  # [rows]
    if (counts < 0).any():
        raise ValueError(f"{what}: sparse CSR row pointers are not monotonic")
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise ValueError(f"{what}: sparse CSR column index out of range [0, {cols})")
    dense = np.zeros(rows * cols, dtype=values.dtype)  # [rows * cols]; unlisted cells are 0 (pad_value=0)
    dense[np.repeat(np.arange(rows, dtype=np.int64), counts) * cols + col] = values
    return dense


def _decode_datum(datum: pb.Datum, max_bytes: int) -> dict[str, Any]:
    pieces = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind is None:
            raise ValueError("model_input chunk has no content")
        if kind != "encoded_text":
            raise ValueError(f"model_input chunk type {kind!r}: {TEXT_ONLY}")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise ValueError(f"encoded_text.tokens: {len(raw)} bytes is not a multiple of the 4-byte item size")
        pieces.append(np.frombuffer(raw, dtype=_I32))  # kept int32: the engine widens them once, as a tensor
    tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.zeros(0, _I32)
    decoded = {
        "input_tokens": tokens,  # int32 [n], read-only
        "loss_fn_inputs": {name: _decode_tensor(t, f"loss_fn_inputs[{name!r}]", max_bytes)
                           for name, t in datum.loss_fn_inputs.items()},
    }
    if datum.model_input_spans or datum.loss_fn_input_spans:  # provenance (SDK 0.38 Datum.with_provenance)
        decoded["model_input_spans"] = _decode_spans(datum.model_input_spans, "model_input_spans")
        decoded["loss_fn_input_spans"] = _decode_spans(datum.loss_fn_input_spans, "loss_fn_input_spans")
    return decoded


def _decode_spans(spans: Any, what: str) -> list[dict[str, Any]]:
    """Provenance runs as {"kind": "prompt" | "sampled", "sequence_id", "offset", "length"} (api/provenance.py
    checks them)."""
    out = []
    for i, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise ValueError(f"{what}[{i}] is neither a prompt nor a sampled span")
        run = getattr(span, kind)
        out.append({"kind": "prompt" if kind == "prompt_tokens" else "sampled", "sequence_id": run.sequence_id,
                    "offset": run.offset, "length": run.length})
    return out


def decode_forward_backward_request(body: bytes, content_encoding: str | None,
                                    max_bytes: int | None = None) -> dict[str, Any]:
    """Decode a `POST /api/v1/forward_backward` body (a ForwardBackwardRequest, maybe zstd-compressed).

    Returns {"model_id", "seq_id", "loss_fn", "forward_only", "loss_fn_config", "data", "body"}: each datum is
    {"input_tokens": int32 array, "loss_fn_inputs": {name: {"dtype": "float32" | "int64", "shape": [...],
    "values": 1-D numpy array}}} and "body" is the uncompressed protobuf (what the server stores).
    Raises ValueError for an unsupported Content-Encoding, a malformed or oversized body (over `max_bytes`,
    default MAX_DECOMPRESSED_BYTES, after decompression) or a model_input chunk other than encoded text."""
    limit = MAX_DECOMPRESSED_BYTES if max_bytes is None else max_bytes
    encoding = (content_encoding or "").strip().lower()
    raw: bytes = body
    if encoding == "zstd":
        raw = bytes(_decompress_zstd(body, limit))
    elif encoding not in ("", "identity"):
        raise ValueError(f"unsupported Content-Encoding {content_encoding!r} (only zstd)")
    if len(raw) > limit:
        raise ValueError(f"request body exceeds {limit} bytes")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise ValueError(f"malformed protobuf ForwardBackwardRequest: {exc}") from exc
    v2: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise ValueError(f"loss_fn_config_v2[{key!r}] must set exactly one of number and text")
        v2[key] = value.number if kind == "number" else value.text
    return {
        "model_id": msg.model_id,
        "seq_id": msg.seq_id,
        "loss_fn": msg.loss_fn,
        "forward_only": msg.forward_only,
        # The SDK dual-writes numbers into both maps and strings only into v2, so v2 is the whole
        # config whenever it is non-empty; the legacy map serves clients that predate it.
        "loss_fn_config": v2 or dict(msg.loss_fn_config),
        "data": [_decode_datum(datum, limit) for datum in msg.data],
        "body": raw,
    }


def _packed(values: Any, dtype: np.dtype, what: str) -> bytes:
    try:
        return np.asarray(values, dtype=dtype).tobytes()
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"{what}: cannot pack as {dtype}: {exc}") from exc


def encode_forward_backward_output(outputs: Sequence[Mapping[str, Any]], metrics: Mapping[str, float],
                                   output_type: str = "ArrayRecord") -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord holding one float32 BatchedTensor per field (per-datum 1-D arrays,
    numpy or sequences, concatenated with int64 byte offsets), plus the metrics map."""
    names: list[str] = []
    for datum in outputs:
        names.extend(k for k in datum if k not in names)
    for i, datum in enumerate(outputs):
        if set(datum) != set(names):
            raise ValueError(f"output {i} has fields {sorted(datum)}, expected {sorted(names)}")
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=output_type, metrics={k: float(v) for k, v in metrics.items()})
    record = msg.loss_fn_outputs.add(num_datums=len(outputs))  # type_tag stays unset: the SDK never reads it
    for name in names:
        arrays = [_packed(datum[name], _F32, f"output field {name!r}") for datum in outputs]
        offsets = np.zeros(len(arrays) + 1, dtype=_I64)  # byte offsets, num_datums + 1 of them
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        field = record.fields[name]
        field.data, field.offsets, field.dtype = b"".join(arrays), offsets.tobytes(), pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def decode_forward_backward_output(body: bytes) -> tuple[str, list[dict[str, np.ndarray]], dict[str, float]]:
    """(loss_fn_output_type, per-datum {field: float32 array}, metrics) of what encode_forward_backward_output made."""
    msg = pb.ForwardBackwardOutput.FromString(body)
    outputs: list[dict[str, np.ndarray]] = []
    for record in msg.loss_fn_outputs:
        per_datum: list[dict[str, np.ndarray]] = [{} for _ in range(record.num_datums)]
        for name, field in record.fields.items():
            data, offsets = np.frombuffer(field.data, dtype=_F32), np.frombuffer(field.offsets, dtype=_I64) // 4
            for i in range(record.num_datums):
                per_datum[i][name] = data[offsets[i] : offsets[i + 1]]
        outputs.extend(per_datum)
    return msg.loss_fn_output_type, outputs, dict(msg.metrics)


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None], out: pb.TopkLogprobs) -> None:
    # Dense length x k matrices; None rows and short rows are filled with the sentinel the SDK trims.
    k = max((len(r) for r in rows if r), default=0)
    cells = [cell for row in rows for cell in [*(row or []), *[_TOPK_SENTINEL] * (k - len(row or []))]]
    out.token_ids = _packed([c[0] for c in cells], _I32, "topk token_ids")
    out.logprobs = _packed([c[1] for c in cells], _F32, "topk logprobs")
    out.k, out.length = k, len(rows)


_TENSOR_DTYPES = {"float32": (pb.DTYPE_FLOAT32, _F32), "int64": (pb.DTYPE_INT64, _I64)}


def _tensor(value: dict[str, Any], out: pb.Tensor, what: str) -> None:
    """TensorData JSON (data, dtype, shape, optional CSR indices) into a Tensor message, keeping its layout."""
    dtype, np_dtype = _TENSOR_DTYPES[value["dtype"]]
    out.dtype = dtype
    out.shape.extend(value["shape"])
    if value.get("sparse_crow_indices") is not None:
        out.sparse_csr.values = _packed(value["data"], np_dtype, what)
        out.sparse_csr.crow_indices = _packed(value["sparse_crow_indices"], _I64, f"{what} crow_indices")
        out.sparse_csr.col_indices = _packed(value["sparse_col_indices"], _I64, f"{what} col_indices")
    else:
        out.dense = _packed(value["data"], np_dtype, what)


def encode_sample_response(
    sequences: list[dict[str, Any]],
    prompt_logprobs: list[float | None] | None = None,
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None,
    *,
    target_prompt_logprobs: dict[str, Any] | None = None,
    prompt_alt_tokens: dict[str, dict[str, Any]] | None = None,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """A SampleResponse. Each sequence is {"tokens", "logprobs" (or None), "stop_reason", optional "topk_logprobs"};
    target_prompt_logprobs and prompt_alt_tokens' tensors are TensorData JSON (engine/executor.py's sample_result)."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for i, seq in enumerate(sequences):
        reason = seq.get("stop_reason", "stop")
        if reason not in _STOP_REASONS:
            raise ValueError(f"sequence {i}: unknown stop_reason {reason!r}")
        out = msg.sequences.add(stop_reason=_STOP_REASONS[reason],
                                tokens=_packed(seq.get("tokens") or [], _I32, f"sequence {i} tokens"))
        if seq.get("logprobs") is not None:  # `optional bytes`: presence is explicit, so even b"" is written
            out.logprobs = _packed(seq["logprobs"], _F32, f"sequence {i} logprobs")
        if seq.get("topk_logprobs") is not None:
            _topk(seq["topk_logprobs"], out.topk_sampled_logprobs)
    if prompt_logprobs is not None:
        msg.prompt_logprobs = _packed([math.nan if v is None else v for v in prompt_logprobs], _F32, "prompt_logprobs")
    if topk_prompt_logprobs is not None:
        _topk(topk_prompt_logprobs, msg.topk_prompt_logprobs)
    if target_prompt_logprobs is not None:
        _tensor(target_prompt_logprobs, msg.target_prompt_logprobs, "target_prompt_logprobs")
    if prompt_alt_tokens is not None:
        _tensor(prompt_alt_tokens["tokens"], msg.prompt_alt_tokens.tokens, "prompt_alt_tokens.tokens")
        _tensor(prompt_alt_tokens["logprobs"], msg.prompt_alt_tokens.logprobs, "prompt_alt_tokens.logprobs")
    return msg.SerializeToString()
