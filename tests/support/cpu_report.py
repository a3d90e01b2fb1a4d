"""pytest plugin: the CPU time each test module costs, its own process's and its reaped children's (servers, engines,
rank processes), summed per module and printed slowest first at the end of the run. On when
$SKYRL_TX_PYTEST_CPU_REPORT names a directory for the workers' figures (tests/run_all.sh sets one); the
table lists the TOP_MODULES costliest.

Why CPU and not --durations: on CI's 2 cores both pytest workers keep the CPUs busy, so a test's wall time includes
the other worker's load, and a module's cost to the run is the CPU it takes from the other. A module-scoped server
stopped at the module's last test is counted there (its process is reaped then); a process never reaped (an
orphaned grandchild) is not counted at all, and the ranks tests/support/rank_reports.py forks from its fork server
are counted only when that server exits, with the test process.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _directory() -> Path | None:
    value = os.environ.get("SKYRL_TX_PYTEST_CPU_REPORT")
    return Path(value) if value else None


TOP_MODULES = 40
_totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])  # module -> [own, children, wall, tests]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    own, children, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    entry = _totals[item.nodeid.split("::")[0]]
    entry[0] += _cpu(resource.RUSAGE_SELF) - own
    entry[1] += _cpu(resource.RUSAGE_CHILDREN) - children
    entry[2] += time.monotonic() - wall
    entry[3] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    directory = _directory()
    if directory is None or not _totals:
        return
    directory.mkdir(parents=True, exist_ok=True)
    name = getattr(session.config, "workerinput", {}).get("workerid", "main")
    (directory / f"{name}.{os.getpid()}.json").write_text(json.dumps(_totals))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    directory = _directory()
    if directory is None or hasattr(terminalreporter.config, "workerinput") or not directory.is_dir():
        return
    merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for path in directory.glob("*.json"):
        for module, values in json.loads(path.read_text()).items():
            merged[module] = [a + b for a, b in zip(merged[module], values)]
        path.unlink()
    if not merged:
        return
    total = sum(own + children for own, children, _, _ in merged.values())
    terminalreporter.section(f"CPU by module: {total:.0f} CPU-s in all (own + reaped children)")
    terminalreporter.write_line(f"{'CPU-s':>8} {'own':>7} {'child':>7} {'wall-s':>7} {'tests':>5}  module")
    ranked = sorted(merged.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for module, (own, children, wall, tests) in ranked[:TOP_MODULES]:
        line = f"{own + children:8.1f} {own:7.1f} {children:7.1f} {wall:7.1f} {tests:5d}  {module}"
        terminalreporter.write_line(line)
