"""make_model_backend: the backend holding the model, in this process alone or as rank 0 of its parallel ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skyrl_tx.config import BackendSettings


def make_model_backend(model_dir: Path, settings: BackendSettings) -> Any:
    """A NativeBackend, or rank 0 of a data/tensor-parallel group (parallel/data_parallel_backend.py) when the
    settings ask for more than one rank. Apart from make_backend (backend/factory.py) so that a sampler engine
    process, which builds its own model this way, does not import the module that starts sampler engines."""
    if settings.fully_sharded_data_parallel_size > 1 or settings.tensor_parallel_size > 1:
        from skyrl_tx.parallel.data_parallel_backend import DataParallelBackend

        return DataParallelBackend.start(model_dir, settings)
    from skyrl_tx.backend.native import NativeBackend

    return NativeBackend(model_dir, settings)
