"""`python -m skyrl_tx.engine --stdio`: the engine child process of a server (see engine/process.py).

It reads its settings JSON as the first line of stdin (it holds secrets: never on the command line, which `ps`
shows to every user), then talks to its parent server over stdin/stdout. `python -m skyrl_tx.engine '<settings
JSON>' [--stdio]` takes them from the command line instead: for tests and debugging only (standalone, beside a
server started with `--engine external`, use `skyrl-tx engine`, which takes secrets from files or the environment)."""

from __future__ import annotations

import json
import logging
import sys
import threading

from skyrl_tx.engine.process import PipeEvents
from skyrl_tx.engine.settings import EngineSettings
from skyrl_tx.errors import SkyrlTxError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stdio = "--stdio" in argv
    argv = [a for a in argv if a != "--stdio"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    if argv:
        raw = argv[0]
    elif stdio:
        raw = sys.stdin.readline()  # before the wake-up reader below takes over stdin
    else:
        print("usage: python -m skyrl_tx.engine --stdio (settings JSON as the first line of stdin)", file=sys.stderr)
        return 2
    if not raw.strip():
        logging.getLogger("skyrl_tx.engine").error("no settings: stdin closed before the settings line")
        return 2
    settings = EngineSettings.from_json(json.loads(raw))
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
    # standalone, nobody listens: skip encoding the results and the stats
    report = PipeEvents(emit) if stdio else (lambda outcomes: None)
    try:
        settings.run(stop, wake, notify=report, on_ready=lambda: emit("ready"))
    except SkyrlTxError as exc:  # a start-up refusal (bad model, a memory plan that cannot fit): its message alone
        logging.getLogger("skyrl_tx.engine").error("%s", exc.message)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
