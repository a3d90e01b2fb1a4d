"""make_backend: the engine's backend, built from its settings (placement: sampler engines or colocated)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from skyrl_tx.backend.model_backend import make_model_backend
from skyrl_tx.config import BackendSettings

log = logging.getLogger("skyrl_tx.parallel")


def make_backend(model_dir: Path, settings: BackendSettings) -> Any:
    """The engine's backend: a NativeBackend, or rank 0 of a data-parallel group when the settings ask for one; with
    colocate_all false, wrapped so that sampling runs on sampler engine processes."""
    if settings.colocate_all and settings.num_inference_engines > 1:  # said, not silently ignored
        log.warning("num_inference_engines=%d has no effect with colocate_all true: sampling runs inside the "
                    "training engine; set colocate_all false for sampler engines of their own",
                    settings.num_inference_engines)
    if settings.colocate_all and settings.inference_engine_tensor_parallel_size > 1:
        log.warning("inference_engine_tensor_parallel_size=%d has no effect with colocate_all true: sampling runs "
                    "inside the training engine, split as it is (tensor_parallel_size %d)",
                    settings.inference_engine_tensor_parallel_size, settings.tensor_parallel_size)
    backend = make_model_backend(model_dir, settings)
    if not settings.colocate_all:
        from skyrl_tx.parallel.sampler_engines import SamplerEnginesBackend

        return SamplerEnginesBackend(backend, model_dir, settings)
    return backend
