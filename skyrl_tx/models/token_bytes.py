"""The raw bytes of every token id and the EOS ids, read from a model directory for the C++ generator."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer


@cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE spells every byte as one printable char."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(spec: dict) -> bool:
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return True
    return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) or [])


def token_bytes_table(model_dir: Path, vocab_size: int) -> list[bytes] | None:
    """bytes per token id (b"" for ids the tokenizer does not define); None without a tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = Tokenizer.from_file(str(path))
    byte_level = _is_byte_level(json.loads(path.read_text()))
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    to_byte = _unicode_to_byte()
    table: list[bytes] = []
    for token_id in range(vocab_size):
        if token_id in added:
            table.append(added[token_id].encode())
            continue
        piece = tokenizer.id_to_token(token_id)
        if piece is None:
            table.append(b"")
        elif byte_level and all(c in to_byte for c in piece):
            table.append(bytes(to_byte[c] for c in piece))
        else:
            table.append(tokenizer.decode([token_id], skip_special_tokens=False).encode())
    return table


def eos_token_ids(model_dir: Path, config_eos: tuple[int, ...]) -> list[int]:
    """config.json's eos ids plus generation_config.json's (which chat models often extend)."""
    ids = list(config_eos)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for token_id in eos if isinstance(eos, list) else ([eos] if eos is not None else []):
            if token_id not in ids:
                ids.append(token_id)
    return ids
