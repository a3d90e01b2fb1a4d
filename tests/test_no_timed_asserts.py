"""No test bounds a wall-clock duration, ratio or rate (CI once failed on 0.799 against 0.8): speed is measured by
`python -m skyrl_tx.bench`, tests assert what holds by construction. The check is tests/support/timed_asserts.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from timed_asserts import timed_asserts, timed_asserts_in

TESTS = Path(__file__).resolve().parent

FLAGGED = {
    "upper bound": "import time\nstarted = time.monotonic()\nassert time.monotonic() - started < 10.0\n",
    "chained bounds": "import time\nt = time.perf_counter()\ntook = time.perf_counter() - t\nassert 1.0 <= took < 10\n",
    "reversed": "from time import monotonic\nt0 = monotonic()\nassert 5 > monotonic() - t0\n",
    "throughput": ("import time\ndef rate(n):\n    t = time.perf_counter()\n    return n / (time.perf_counter() - t)\n"
                   "def test():\n    assert rate(8) >= 100\n"),
    # the old test_background_saves: best-of-five durations collected by a helper, then their ratio
    "best-of ratio": ("import time\ndef seconds():\n    started = time.perf_counter()\n"
                      "    return time.perf_counter() - started\n"
                      "def test():\n    alone, saving = [], []\n    for _ in range(5):\n"
                      "        alone.append(seconds())\n        saving.append(seconds())\n"
                      "    ratio = min(alone) / min(saving)\n    assert ratio >= 0.8\n"),
    # the old test_sampling_share: time summed per kind in a closure, the fraction returned and bounded
    "closure fraction": ("import time\ndef fraction():\n    spent = {'a': 0.0, 'b': 0.0}\n    def run():\n"
                         "        started = time.perf_counter()\n        spent['a'] += time.perf_counter() - started\n"
                         "    run()\n    return spent['a'] / (spent['a'] + spent['b'])\n"
                         "def test():\n    assert fraction() < 0.3\n"),
    "tuple from a helper": ("import time\ndef timed(x):\n    t = time.monotonic()\n    return x, time.monotonic() - t\n"
                            "def test():\n    value, took = timed(1)\n    assert took <= 2.0\n"),
    "datetimes": ("from datetime import datetime\nstart = datetime.now()\n"
                  "assert (datetime.now() - start).total_seconds() < 3\n"),
}
ALLOWED = {
    "bounded timeout": ("import time\ndeadline = time.monotonic() + 30\nwhile time.monotonic() < deadline:\n    pass\n"
                        "assert time.monotonic() < deadline, 'timed out'\n"),
    "lower bound": ("import time\nstarted = time.monotonic()\nwaited = time.monotonic() - started\n"
                    "assert waited >= 1.0\n"),
    "printed only": ("import time\nt = time.perf_counter()\nsteps = [1, 2]\nprint(time.perf_counter() - t)\n"
                     "assert steps == [1, 2]\n"),
    "time in a message": "import time\nt = time.monotonic()\nassert True, f'{time.monotonic() - t} s'\n",
    "duration beside other results": ("import time\ndef timed(x):\n    t = time.monotonic()\n"
                                      "    return x, time.monotonic() - t\n"
                                      "def test():\n    value, took = timed(1)\n    print(took)\n"
                                      "    assert value == 1\n"),
}


@pytest.mark.parametrize("name", sorted(FLAGGED))
def test_the_check_flags_a_bound_on_a_wall_clock_time(name: str) -> None:
    assert len(timed_asserts({name: FLAGGED[name]})) == 1, FLAGGED[name]


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_the_check_allows_deadlines_lower_bounds_and_printed_times(name: str) -> None:
    assert timed_asserts({name: ALLOWED[name]}) == [], ALLOWED[name]


def test_no_test_bounds_a_wall_clock_duration_ratio_or_rate() -> None:
    found = timed_asserts_in(TESTS)
    assert found == [], "assert what the code guarantees, and measure speed in skyrl_tx/bench:\n" + "\n".join(found)
