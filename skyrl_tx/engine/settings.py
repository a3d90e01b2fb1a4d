"""EngineSettings: what an engine process needs to start (JSON on its stdin, never argv), and how it starts."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skyrl_tx.config import BackendSettings, ServerSettings
from skyrl_tx.db.future_queries import Notify
from skyrl_tx.engine.threads import ThreadChoice, configure_threads

log = logging.getLogger("skyrl_tx.engine")


@dataclass(frozen=True)
class EngineSettings:
    base_model: str
    model_dir: str  # resolved by the server, so both processes use the very same files
    database_url: str = field(repr=False)  # may hold a password
    checkpoints_base: str
    backend: dict[str, Any] = field(default_factory=dict)  # BackendSettings fields
    checkpoints_storage_options: dict[str, Any] = field(default_factory=dict, repr=False)  # credentials
    session_timeout_s: float = 300.0
    external_inference_url: str | None = None  # sampling through vLLM (engine/external_sampler.py)

    @classmethod
    def for_server(cls, settings: ServerSettings, model_dir: Path, database_url: str,
                   checkpoints_base: str) -> EngineSettings:
        return cls(base_model=settings.base_model, model_dir=str(model_dir), database_url=database_url,
                   checkpoints_base=checkpoints_base, backend=dataclasses.asdict(settings.backend),
                   checkpoints_storage_options=dict(settings.checkpoints_storage_options),
                   session_timeout_s=settings.session_timeout_s,
                   external_inference_url=settings.external_inference_url)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> EngineSettings:
        return cls(**raw)

    def configure_threads(self) -> ThreadChoice:
        """Sizes this process's thread pools to its share of the cores it owns and logs the choice
        (engine/threads.py): one share per compute process of its node (its ranks and sampler engines, which
        inherit that count and take one share each)."""
        from skyrl_tx.parallel.layout import engine_node_processes

        backend = BackendSettings.from_dict(self.backend)
        return configure_threads(backend.device, backend.num_threads, local_ranks=engine_node_processes(backend))

    def run(self, stop: threading.Event, wake: threading.Event, notify: Notify,
            on_ready: Callable[[], None]) -> None:
        """Loads the base model and runs the engine loop until `stop` is set (this thread owns the backend)."""
        backend_settings = BackendSettings.from_dict(self.backend)
        self.configure_threads()  # before the imports below load torch (a no-op if __main__ did it already)

        from skyrl_tx.backend.factory import make_backend
        from skyrl_tx.models.hf_config import load_decoder_config
        from skyrl_tx.plan.capacity import check_fits
        from skyrl_tx.plan.inventory import model_params

        # A layout whose memory plan exceeds a device's whole memory is refused here, naming the key to change,
        # instead of running out of memory minutes into the load or the first step (skyrl_tx/plan/).
        trainer_plan = check_fits(load_decoder_config(Path(self.model_dir)), backend_settings).devices[0]
        started = time.perf_counter()
        log.info("loading base model %s from %s (dtype=%s, device=%s)", self.base_model, self.model_dir,
                 backend_settings.dtype, backend_settings.device)
        backend = make_backend(Path(self.model_dir), backend_settings)  # data-parallel ranks when configured
        try:
            cfg = backend.decoder_config
            log.info("model loaded: %s (%d layers, hidden %d, vocab %d; %s parameters, %s of %s weights on %s) "
                     "in %.1fs", cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size,
                     _count(sum(p.numel for p in model_params(cfg))), _size(trainer_plan.lines["weights"]),
                     backend_settings.dtype, backend_settings.device, time.perf_counter() - started)
            self._serve(backend, stop, wake, notify, on_ready)
        finally:
            # Stops the processes the backend started (data-parallel ranks, sampler engines: told to stop, joined,
            # killed after 10 s). Without it a tensor-parallel sampler engine (not a daemon: it starts ranks of its
            # own) waits for a command forever, the interpreter's exit joins it forever, and the whole group
            # outlives its server (seen: ~4 GB of orphans per stopped server in the test suite).
            backend.close()

    def _serve(self, backend: Any, stop: threading.Event, wake: threading.Event, notify: Notify,
               on_ready: Callable[[], None]) -> None:
        """The engine loop over `backend` (its database, checkpoint store, recovery), run until `stop` is set."""
        from skyrl_tx.checkpoints.store import CheckpointStore
        from skyrl_tx.db.session import make_engine, make_session_factory
        from skyrl_tx.engine.runner import build_loop, run_engine

        sessions = make_session_factory(make_engine(self.database_url))
        store = CheckpointStore(self.checkpoints_base, self.checkpoints_storage_options)
        loop = build_loop(backend, sessions, store, Path(self.model_dir), notify, self.session_timeout_s,
                          external_inference_url=self.external_inference_url)
        run_engine(loop, stop, wake, on_ready=on_ready)


def _count(n: int) -> str:
    """1234567 -> '1.23M' (parameters in a log line)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
