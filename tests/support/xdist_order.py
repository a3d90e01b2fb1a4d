"""pytest plugin: the order in which a run with workers (pytest-xdist, `-n 2 --dist loadfile
--no-loadscope-reorder`, as tests/run_all.sh runs it) hands out the modules: the slowest first (tests/conftest.py
loads it).

xdist's `loadfile` keeps each module on one worker, so a module-scoped server (or vLLM, or parallel layout) starts
once. Not `loadgroup` with an `xdist_group` mark per module: xdist 3.8 adds the group to `item._nodeid`, which
pytest 9.2 no longer reads (the node id lives in `item._id`), so the marks grouped nothing and modules were split
over both workers, each starting its own servers (two vLLMs at once, two one-process references for
test_parallel_examples).

Why the slow ones first: workers take modules in collection order, so a 5-minute module collected last runs alone
while the other worker has nothing left. tests/run_all.sh runs tests/plan/test_real_shapes.py alone before the
workers start: its peak-memory check reads the engine's resident pages, which the other worker's memory pressure
lowers. Without workers (plain `pytest`), nothing here changes anything: the collection order as written.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Modules or folders whose tests take minutes in all (CI's --durations), slowest first; the rest keep their order.
# Except vLLM's (~2 min): after the ~7 worker-minutes of tests/bench and tests/parallel, since tests/run_all.sh
# installs its venv in the background (niced) while the tests start, and its server waits for that install.
SLOW_FIRST = ("tests/plan/test_real_shapes.py", "tests/api/test_engine_kills.py", "tests/bench/", "tests/parallel/",
              "tests/external/test_vllm_engine.py", "tests/cookbook/", "tests/api/test_request_order.py",
              "tests/api/test_keys.py", "tests/console/")


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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only xdist's workers collect (the controller schedules what they report); `workerinput` marks a worker. Every
    # worker runs this on the same collection: the result must be deterministic (xdist refuses to run when the
    # workers' collections differ).
    if not hasattr(config, "workerinput"):
        return
    root = config.rootpath.resolve()
    paths = {id(item): _relative(item, root) for item in items}
    items.sort(key=lambda item: _rank(paths[id(item)]))  # stable: within a rank, the order as collected
