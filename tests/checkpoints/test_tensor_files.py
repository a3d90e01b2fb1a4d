"""TensorFile: safetensors written tensor by tensor (what safetensors itself loads back), in the asked dtype, in
bounded writes, and published through the store locally and to S3 as a multipart upload (moto_server)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
from s3_server import make_bucket, moto_s3, s3_options
from safetensors.torch import load

from skyrl_tx.checkpoints import tensor_files
from skyrl_tx.checkpoints.paths import TinkerPath
from skyrl_tx.checkpoints.store import CheckpointStore
from skyrl_tx.checkpoints.tensor_files import TensorFile

TENSORS = {"b.weight": torch.randn(3, 5), "a.ids": torch.arange(7), "c.half": torch.randn(4).to(torch.bfloat16),
           "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False, True]),
           "strided": torch.randn(6, 4).t()}


def test_safetensors_loads_what_it_writes_with_metadata() -> None:
    f = TensorFile(TENSORS, metadata={"step": "3"})
    raw = f.to_bytes()
    assert len(raw) == f.size()
    loaded = load(raw)
    assert loaded.keys() == TENSORS.keys()
    assert all(torch.equal(loaded[k], TENSORS[k]) for k in TENSORS)
    header_len = int.from_bytes(raw[:8], "little")
    assert (8 + header_len) % 8 == 0 and b'"step":"3"' in raw[8:8 + header_len]


def test_floating_tensors_are_written_in_the_asked_dtype() -> None:
    loaded = load(TensorFile(TENSORS, cast_to=torch.bfloat16).to_bytes())
    assert loaded["b.weight"].dtype == torch.bfloat16 and torch.equal(loaded["b.weight"], TENSORS["b.weight"].bfloat16())
    assert loaded["a.ids"].dtype == torch.int64 and loaded["mask"].dtype == torch.bool  # only floats are cast


class RecordingFile(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def write(self, data) -> int:
        self.largest = max(self.largest, len(memoryview(data).cast("B")))
        return super().write(data)


def test_writes_are_bounded_never_the_whole_file(monkeypatch) -> None:
    monkeypatch.setattr(tensor_files, "WRITE_CHUNK_BYTES", 4096)
    big = {"w": torch.randn(256, 256), "v": torch.randn(100)}  # 256 KiB + 400 B
    out = RecordingFile()
    TensorFile(big).write_to(out)
    assert out.largest <= 4096
    assert all(torch.equal(load(out.getvalue())[k], big[k]) for k in big)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


def test_s3_publish_streams_a_multipart_upload(s3_endpoint) -> None:
    make_bucket(s3_endpoint, "tensor-files")
    # 5 MiB parts (S3's smallest): a 12 MB file is uploaded in three parts, never buffered whole.
    store = CheckpointStore("s3://tensor-files/ckpts", {**s3_options(s3_endpoint), "default_block_size": 5 << 20})
    weights = {"w": torch.randn(3_000_000)}
    location = store.location(TinkerPath("s:train:0", "weights", "big"))
    size = store.publish(location, {"model.safetensors": TensorFile(weights), "skyrl_state.json": b"{}"})
    assert store.files(location) == {"model.safetensors": size - 2, "skyrl_state.json": 2}
    assert torch.equal(load(store.read(location, "model.safetensors"))["w"], weights["w"])
