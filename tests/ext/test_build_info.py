"""The extension imports, reports what it was built with, and refuses a mismatched torch loudly."""

from __future__ import annotations

import pytest
import torch

from skyrl_tx import _build_info
from skyrl_tx._ext import load_extension


def test_extension_imports_and_reports_build() -> None:
    _C = load_extension()
    info = _C.build_info()
    assert info["torch_version"] == torch.__version__ == _build_info.TORCH_VERSION
    assert info["cxx11_abi"] == bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    assert info["cuda"] == _build_info.WITH_CUDA
    assert info["nccl"] == _build_info.WITH_NCCL
    assert hasattr(_C, "NcclCommunicator") == _build_info.WITH_NCCL


def test_mismatched_torch_names_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "2.0.0+cpu")
    load_extension.cache_clear()
    try:
        with pytest.raises(ImportError) as info:
            load_extension()
        message = str(info.value)
        assert "2.0.0+cpu" in message and torch.__version__ in message
        assert "pip install --no-build-isolation" in message
    finally:
        load_extension.cache_clear()
