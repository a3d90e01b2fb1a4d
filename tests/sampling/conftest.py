"""Sampling tests run one intra-op thread: the tiny models gain nothing from more, and on a busy 2-core machine
OpenMP threads spinning against other processes made these small-kernel workloads several times slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
