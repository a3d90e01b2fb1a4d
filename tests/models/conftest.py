"""Fixtures of the per-architecture tests: a module defines `path` (its preset's directory, maybe parametrized) and
gets our backend and the transformers reference of that checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import load_hf_model

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.config import BackendSettings


@pytest.fixture(scope="module")
def backend(path: Path) -> NativeBackend:
    return NativeBackend(path, BackendSettings(max_lora_adapters=3, max_lora_rank=8))


@pytest.fixture(scope="module")
def hf(path: Path) -> torch.nn.Module:
    return load_hf_model(path)
