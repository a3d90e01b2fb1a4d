"""Unmodified tinker-cookbook recipes and the examples/ scripts, run as subprocesses against a live server.

One server per test module (tests/support/live_server.py) serves the tiny preset `tiny-qwen3` and, through
`--model-alias`, also under the preset directory's path: the recipes take that path as `model_name`, so
`tokenizer_utils.get_tokenizer` loads the preset's tokenizer from disk (no hub). Every recipe runs as
`python -m tinker_cookbook.recipes...` with TINKER_BASE_URL pointing at the server (several recipes have no
base_url flag), HF hub access off, and a working directory holding copies of tests/cookbook/data/ (datasets
named like their hub ids, e.g. `Anthropic/hh-rlhf/train.jsonl`, which `datasets.load_dataset` finds locally).

Tests assert on what a recipe writes (metrics.jsonl, checkpoints.jsonl, its log), not only its exit code.

Markers: every test here is `cookbook`; the ones marked `cookbook_full` run only with SKYRL_TX_COOKBOOK_FULL=1:
    SKYRL_TX_COOKBOOK_FULL=1 OMP_NUM_THREADS=1 python -m pytest tests/cookbook -q
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from client_scripts import client_argv, exited_cleanly
from live_server import ServerUrl, live_server

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATA = HERE / "data"
API_KEY = "tml-cookbook"
FULL_ENV = "SKYRL_TX_COOKBOOK_FULL"
RECIPE_TIMEOUT_S = 300
# Hugging Face names some recipes use by default: the server answers to them (--model-alias) and the working
# directory has a directory of that name linking to the preset, where the cookbook's get_tokenizer finds it.
HF_ALIASES = ("Qwen/Qwen3.5-4B",)
OUTPUT_TAIL_CHARS = 6000


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    full = os.environ.get(FULL_ENV) == "1"
    skip_full = pytest.mark.skip(reason=f"part of the full cookbook set: set {FULL_ENV}=1")
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.cookbook)
        if "cookbook_full" in item.keywords and not full:
            item.add_marker(skip_full)


@pytest.fixture(scope="session")
def cookbook_installed() -> None:
    if importlib.util.find_spec("tinker_cookbook") is None:
        message = ("tinker-cookbook is not installed: pip install --no-deps tinker-cookbook==0.6.1 "
                   "(its other dependencies come with the `test` extra)")
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    """The tiny-qwen3 preset directory: the recipes' `model_name` (and a name the server answers to)."""
    return tiny_model_dir("tiny-qwen3")


@pytest.fixture(scope="module")
def server_options(model_dir: Path) -> dict[str, Any]:
    # Recipes neither close their sessions nor unload their models: room for every training client of a module.
    return {"base_model": "tiny-qwen3", "aliases": [str(model_dir), *HF_ALIASES],
            "backend_config": {"max_lora_adapters": 32}}


@pytest.fixture(scope="module")
def server_url(cookbook_installed: None, server_options: dict[str, Any], preset_cache: Path) -> Iterator[ServerUrl]:
    with live_server(**server_options) as url:
        yield url


@pytest.fixture(scope="module")
def client_env(server_url: ServerUrl, preset_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of a recipe or example process: this module's server, no hub, one thread."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    return {**os.environ, "TINKER_BASE_URL": server_url, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(hf_home), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "SKYRL_TX_CACHE_DIR": str(preset_cache), "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}


@dataclasses.dataclass
class RecipeRun:
    log_path: Path
    output: str

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl rows that carry a step's metrics (the recipes also append bare {"step": n} rows)."""
        path = self.log_path / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        return [row for row in rows if len(row) > 1]

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        path = self.log_path / "checkpoints.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def series(self, key: str) -> list[float]:
        values = [row[key] for row in self.metrics if key in row]
        assert values, f"no {key!r} in {self.log_path}/metrics.jsonl; keys: {sorted(self.metric_keys())}"
        return values

    def metric_keys(self) -> set[str]:
        return {key for row in self.metrics for key in row}

    def assert_finite(self) -> None:
        """Every numeric metric of every step is finite (no NaN or inf anywhere)."""
        assert self.metrics, f"no metrics in {self.log_path}/metrics.jsonl\n{self.tail()}"
        bad = [(row.get("step"), key, value) for row in self.metrics for key, value in row.items()
               if isinstance(value, float) and not math.isfinite(value)]
        assert not bad, f"non-finite metrics (step, key, value): {bad[:20]}"

    def tail(self) -> str:
        return self.output[-OUTPUT_TAIL_CHARS:]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """The recipes' working directory: a copy of tests/cookbook/data (local stand-ins for hub datasets) and
    HF_ALIASES directories (links to the preset)."""
    root = tmp_path_factory.mktemp("cookbook_cwd")
    shutil.copytree(DATA, root, dirs_exist_ok=True)
    for name in HF_ALIASES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(model_dir, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def run_recipe(client_env: dict[str, str], workdir: Path, server_url: ServerUrl,
               tmp_path_factory: pytest.TempPathFactory) -> Callable[..., RecipeRun]:
    """run_recipe(module, *key=value args, log_path=None, expect_ok=True, log_dir_flag=True) → RecipeRun.

    Runs `python -m <module> <args> log_path=... behavior_if_log_dir_exists=...` (args override both) in
    `workdir`; a failure shows the recipe's output tail and the server log tail."""

    def run(module: str, *args: str, log_path: Path | None = None, timeout: float = RECIPE_TIMEOUT_S,
            expect_ok: bool = True, log_dir_flag: bool = True) -> RecipeRun:
        if log_path is None:
            log_path = tmp_path_factory.mktemp(module.rsplit(".", 2)[-2]) / "log"
        keys = {a.split("=", 1)[0] for a in args}
        defaults = [f"log_path={log_path}"] if "log_path" not in keys else []
        # (rl_loop, sl_loop have no behavior_if_log_dir_exists: log_dir_flag=False)
        if log_dir_flag and "behavior_if_log_dir_exists" not in keys:
            defaults.append("behavior_if_log_dir_exists=delete")
        argv = client_argv("-m", module, *defaults, *args)
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=workdir, env=client_env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
            output, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            code = f"timeout after {timeout:.0f} s"
        elapsed = time.monotonic() - started
        sys.stderr.write(f"[cookbook] {module} {' '.join(args)}: {code} in {elapsed:.1f} s\n")
        result = RecipeRun(Path(log_path), output)
        if expect_ok and not exited_cleanly(code, output):
            pytest.fail(f"{' '.join(argv[3:])}\nexited with {code}\n---- recipe output (tail) ----\n{result.tail()}\n"
                        f"---- server log (tail) ----\n{server_url.log_tail()}", pytrace=False)
        return result

    return run


@pytest.fixture(scope="module")
def run_example(client_env: dict[str, str], server_url: ServerUrl) -> Callable[..., str]:
    """run_example(script_name, env overrides) → stdout of examples/<script_name> (asserting exit code 0)."""

    def run(script: str, *args: str, timeout: float = RECIPE_TIMEOUT_S, **env: str) -> str:
        argv = client_argv(str(REPO / "examples" / script), *args)
        try:
            proc = subprocess.run(argv, cwd=REPO, env={**client_env, **env}, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # a hang: show where the script and the server stopped
            def text(out: bytes | str | None) -> str:
                return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")

            pytest.fail(f"{script} did not finish in {timeout:.0f} s\n---- stdout ----\n{text(exc.stdout)}\n"
                        f"---- stderr (tail) ----\n{text(exc.stderr)[-OUTPUT_TAIL_CHARS:]}\n"
                        f"---- server log (tail) ----\n{server_url.log_tail()}", pytrace=False)
        assert exited_cleanly(proc.returncode, proc.stderr), (
            f"{script} exited with {proc.returncode}\n---- stdout ----\n{proc.stdout}\n"
            f"---- stderr (tail) ----\n{proc.stderr[-OUTPUT_TAIL_CHARS:]}\n"
            f"---- server log (tail) ----\n{server_url.log_tail()}")
        return proc.stdout

    return run


@pytest.fixture(scope="module")
def rest(server_url: ServerUrl) -> Any:
    """A tinker.RestClient on this module's server (training runs and checkpoints)."""
    import tinker

    return tinker.RestClient(base_url=server_url, api_key=API_KEY)

