"""`python -m skyrl_tx.engine '<settings JSON>' [--stdio]`: the engine process (see engine/process.py).

With --stdio it talks to its parent server over stdin/stdout; without it, it runs standalone beside a
server started with `--engine external` (both find each other only through the database)."""

from __future__ import annotations

import json
import logging
import sys
import threading

from skyrl_tx.db.future_queries import FutureOutcome
from skyrl_tx.engine.process import done_line
from skyrl_tx.engine.settings import EngineSettings


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stdio = "--stdio" in argv
    argv = [a for a in argv if a != "--stdio"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    settings = EngineSettings.from_json(json.loads(argv[0]))
    settings.configure_threads()  # first, before anything loads torch: OpenMP reads its wait policy at load
    events = sys.stdout
    sys.stdout = sys.stderr  # nothing but protocol lines may reach the parent's pipe
    stop, wake = threading.Event(), threading.Event()

    def emit(line: str) -> None:
        if stdio:
            events.write(line + "\n")
            events.flush()

    if stdio:
        def read_wakeups() -> None:
            for _ in sys.stdin:
                wake.set()
            stop.set()  # stdin closed: the server is gone or stopping us
            wake.set()

        threading.Thread(target=read_wakeups, name="skyrl-tx-engine-wakeups", daemon=True).start()
    def report(outcomes: list[FutureOutcome]) -> None:
        if stdio:  # standalone, nobody listens: skip encoding the results
            emit(done_line(outcomes))

    settings.run(stop, wake, notify=report, on_ready=lambda: emit("ready"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
