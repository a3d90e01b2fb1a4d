"""TensorFile: a safetensors file written tensor by tensor into an open stream, never built whole in memory.

safetensors.torch.save builds the whole file as one bytes object (plus a bytes copy of every tensor): for a
full fine-tuning checkpoint that is two extra copies of the model. Here only the JSON header is built up front
(it needs just names, dtypes and shapes); each tensor's bytes are then written straight from its storage
(a bf16 / fp16 cast, when asked, is made one tensor at a time). Into an fsspec object-store file the writes
become a multipart upload, part by part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:  # the API imports the store (and so this module) and must not load torch
    import torch

SAFETENSORS_DTYPES = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                      "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8",
                      "torch.uint8": "U8", "torch.bool": "BOOL"}
WRITE_CHUNK_BYTES = 64 << 20  # one write call per 64 MiB: bounded buffers in object-store uploads


@dataclass
class TensorFile:
    """tensors: name → CPU tensor (the caller's private copy); cast_to: floating tensors are written in this
    dtype (the model's, e.g. bf16: a float32 host copy of bf16 weights is not saved upcast)."""

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str] | None = None
    cast_to: torch.dtype | None = None

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.cast_to if self.cast_to is not None and t.is_floating_point() else t.dtype

    def header(self) -> bytes:
        """The 8-byte length + JSON header, padded with spaces to 8-byte alignment (as safetensors does)."""
        entries: dict[str, object] = {}
        if self.metadata:
            entries["__metadata__"] = {str(k): str(v) for k, v in self.metadata.items()}
        offset = 0
        for name in sorted(self.tensors):
            t = self.tensors[name]
            dtype = self._dtype(t)
            if str(dtype) not in SAFETENSORS_DTYPES:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors code")
            size = t.numel() * dtype.itemsize
            entries[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype)], "shape": list(t.shape),
                             "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)
        return len(text).to_bytes(8, "little") + text

    def size(self) -> int:
        return len(self.header()) + sum(t.numel() * self._dtype(t).itemsize for t in self.tensors.values())

    def write_to(self, out: BinaryIO) -> int:
        """Writes the whole file into `out`; returns the bytes written."""
        import torch

        header = self.header()
        out.write(header)
        written = len(header)
        for name in sorted(self.tensors):
            t = self.tensors[name].detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.to(self._dtype(t)).contiguous().reshape(-1)  # [numel]: no copy unless cast or strided
            data = memoryview(t.view(torch.uint8).numpy())  # [numel * element size]: the tensor's own bytes
            for start in range(0, len(data), WRITE_CHUNK_BYTES):
                out.write(data[start:start + WRITE_CHUNK_BYTES])
            written += len(data)
        return written

    def to_bytes(self) -> bytes:
        """The file as bytes (small files and tests)."""
        import io

        buffer = io.BytesIO()
        self.write_to(buffer)
        return buffer.getvalue()
