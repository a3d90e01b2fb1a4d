"""Shared pytest fixtures: a hermetic preset cache and the tiny model directories; gpu auto-skip; live servers' log
tails in failure reports; the test process's exit without interpreter finalization."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The process ends with pytest's exit status once the summary is printed, before interpreter finalization (which the
# SDK transport's threads can abort): tests/support/exit_status.py says why.
from exit_status import pytest_sessionfinish  # noqa: F401  (a hook: pytest finds it in this module)
import cpu_report
import xdist_order


def pytest_configure(config: pytest.Config) -> None:
    # With workers (pytest-xdist, as tests/run_all.sh runs): slow modules first (xdist_order.py).
    config.pluginmanager.register(xdist_order, "skyrl_tx_xdist_order")
    # With $SKYRL_TX_PYTEST_CPU_REPORT: the CPU each module cost, printed at the end (cpu_report.py).
    config.pluginmanager.register(cpu_report, "skyrl_tx_cpu_report")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> object:
    """A failed test that used a live server (a fixture value with `log_tail`, tests/support/live_server.py) shows the
    server's log tail in its report: a module-scoped server's log is otherwise never printed for one test's failure,
    and a hang or error on the server side is only visible there."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        if callable(getattr(value, "log_tail", None)):
            report.sections.append((f"skyrl_tx server log ({name}: {value}), tail", value.log_tail()))


@pytest.fixture(scope="session")
def preset_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated tiny models live in a per-session directory, never in the user's cache; or in
    $SKYRL_TX_TEST_PRESET_CACHE, which tests/run_all.sh sets to one directory of its own for all its pytest processes
    (the workers and the real-shape phase): each preset is then generated once per run instead of once per worker,
    ~6 CPU-s each (transformers' import in the server that generates it). Generation is safe to race
    (tiny_presets.resolve_preset: a file lock and a rename into place)."""
    shared = os.environ.get("SKYRL_TX_TEST_PRESET_CACHE")
    root = Path(shared) if shared else tmp_path_factory.mktemp("skyrl_tx_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SKYRL_TX_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_model_dir(preset_cache: Path):
    """tiny_model_dir(name) → the generated preset directory (cached for the session)."""
    from skyrl_tx.models.tiny_presets import resolve_preset

    def get(name: str) -> Path:
        path = resolve_preset(name)
        assert path is not None, name
        return path

    return get
