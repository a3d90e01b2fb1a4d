"""pytest plugin: how a run with workers (pytest-xdist, `-n 2 --dist loadgroup`, as tests/run_all.sh runs it) shares
the tests out: a module's tests stay on one worker, the slowest modules start first, the memory-heavy ones queue
behind each other (tests/conftest.py loads it).

Why a module per worker: most modules start a live server (or a vLLM, or a parallel layout) in a module-scoped
fixture; split across workers, each worker would start its own, and a server start (two processes importing their
libraries, the engine loading a model) costs more than most tests. Why the slow ones first: workers take modules in
collection order, so a 5-minute module collected last runs alone while the other worker has nothing left. Why one
queue for the heavy ones: the real-shape checkpoints (an engine of up to 12 GiB beside transformers' copy of the
model) and a real vLLM must not run beside each other on CI's 24 GiB.

tests/run_all.sh runs tests/plan/test_real_shapes.py alone before the workers start: its peak-memory check reads
the engine's resident pages, which the other worker's memory pressure lowers. Without workers (plain `pytest`),
nothing here changes anything: no marks, the collection order as written.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Modules that need several GiB of host memory at once: one queue, one worker.
MEMORY_HEAVY = ("tests/plan/test_real_shapes.py", "tests/external/test_vllm_engine.py")
MEMORY_HEAVY_GROUP = "memory-heavy"
# Modules or folders whose tests take minutes in all (CI's --durations), slowest first; the rest keep their order.
SLOW_FIRST = (*MEMORY_HEAVY, "tests/api/test_engine_kills.py", "tests/bench/", "tests/parallel/", "tests/cookbook/",
              "tests/api/test_request_order.py", "tests/api/test_keys.py", "tests/console/")


def _relative(item: pytest.Item, root: Path) -> str:
    try:
        return Path(str(item.fspath)).resolve().relative_to(root).as_posix()
    except ValueError:
        return Path(str(item.fspath)).as_posix()


def _rank(path: str) -> int:
    for index, prefix in enumerate(SLOW_FIRST):
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return index
    return len(SLOW_FIRST)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into the node ids' @group suffix
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only xdist's workers collect (the controller schedules what they report), and xdist sets `loadgroup` on them
    # for --dist loadgroup. Every worker runs this on the same collection: the result must be deterministic (xdist
    # refuses to run when the workers' collections differ).
    if not getattr(config.option, "loadgroup", False):
        return
    root = config.rootpath.resolve()
    paths = {id(item): _relative(item, root) for item in items}
    items.sort(key=lambda item: _rank(paths[id(item)]))  # stable: within a rank, the order as collected
    for item in items:
        path = paths[id(item)]
        item.add_marker(pytest.mark.xdist_group(MEMORY_HEAVY_GROUP if path in MEMORY_HEAVY else path))
