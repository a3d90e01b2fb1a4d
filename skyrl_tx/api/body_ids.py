"""forward_backward_ids: the model_id and seq_id at the start of a forward_backward body that cannot be used whole
(too large, a chunk type this server does not take, malformed further on), so its rejection still consumes the
seq_id (api/submit.py record_rejected) and the model's later requests do not wait for it."""

from __future__ import annotations

PREFIX_BYTES = 64 * 1024  # model_id (field 1) and seq_id (field 2) are the first fields the SDK writes
_MODEL_ID_TAG, _SEQ_ID_TAG = (1 << 3) | 2, (2 << 3) | 0  # ForwardBackwardRequest: string model_id = 1; int32 seq_id = 2


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _inflate_prefix(body: bytes, encoding: str | None) -> bytes:
    if (encoding or "").strip().lower() != "zstd":
        return body[:PREFIX_BYTES]
    import zstandard  # lazy: only zstd bodies need it

    out, obj = bytearray(), zstandard.ZstdDecompressor().decompressobj()
    # Up to 1 MiB of compressed input (a block is only output once complete: up to 128 KiB of it), in small steps:
    # a bomb's RLE blocks inflate 64 bytes to ~2 MiB at most before the output check stops it.
    for pos in range(0, min(len(body), 1024 * 1024), 64):
        try:
            out += obj.decompress(body[pos : pos + 64])
        except zstandard.ZstdError:
            break
        if len(out) >= PREFIX_BYTES or obj.eof:
            break
    return bytes(out[:PREFIX_BYTES])


def forward_backward_ids(body: bytes, encoding: str | None) -> tuple[str, int] | None:
    """(model_id, seq_id) from the first fields of a ForwardBackwardRequest body (maybe zstd, maybe cut off), or
    None where they are not both there. seq_id is read as the int32 the schema says (negative values stay negative)."""
    data = _inflate_prefix(body, encoding)
    model_id: str | None = None
    seq_id: int | None = None
    pos = 0
    try:
        while pos < len(data) and (model_id is None or seq_id is None):
            tag, pos = _varint(data, pos)
            if tag == _MODEL_ID_TAG:
                length, pos = _varint(data, pos)
                if pos + length > len(data):
                    return None
                model_id, pos = data[pos : pos + length].decode("utf-8"), pos + length
            elif tag == _SEQ_ID_TAG:
                raw, pos = _varint(data, pos)
                seq_id = raw - (1 << 64) if raw >= 1 << 63 else raw
            else:  # a later field: a zero seq_id was left out (proto3), or model_id is not first (then: None)
                break
    except (ValueError, UnicodeDecodeError):
        return None
    if model_id is None:
        return None
    return model_id, seq_id or 0  # proto3 leaves a zero seq_id out of the body
