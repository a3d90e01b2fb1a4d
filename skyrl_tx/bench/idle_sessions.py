"""`python -m skyrl_tx.bench idle-sessions`: many sessions idle for minutes, heartbeating, keep every model.

Starts a server (tiny preset, one adapter slot per session), opens N tinker ServiceClients with one LoRA training
client each, trains one step each, then does nothing for `--minutes` while the SDKs heartbeat (every 10 s), and
finally checks that every model is still served (a forward pass on each) and that none was unloaded. Reports the
heartbeat rate the server absorbed and how long the final round took. A bench mode, not a CI test (it takes minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from skyrl_tx.bench.live_server import bench_server
from skyrl_tx.bench.mixed_load import TOKENS


def run_idle_sessions(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench idle-sessions", description=__doc__.split("\n")[0])
    parser.add_argument("--base-model", default="tiny-qwen3")
    parser.add_argument("--sessions", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--session-timeout", type=float, default=60.0,
                        help="the server's --session-timeout: well under the idle time, so a missed heartbeat shows")
    args = parser.parse_args(argv)
    import tinker
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    backend_config = {"max_lora_adapters": args.sessions}
    with bench_server(args.base_model, name="bench idle-sessions", args=[
            "--backend-config", json.dumps(backend_config), "--session-timeout", str(args.session_timeout)]) as live:
        os.environ.update(TINKER_BASE_URL=live.url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
        services = [tinker.ServiceClient() for _ in range(args.sessions)]
        with ThreadPoolExecutor(16) as pool:
            clients = list(pool.map(lambda s: s.create_lora_training_client(base_model=args.base_model, rank=1).result(),
                                    services))
            list(pool.map(lambda c: c.forward_backward([datum], "cross_entropy").result(), clients))
        print(f"{args.sessions} sessions with a model each; idle for {args.minutes:g} min "
              f"(session timeout {args.session_timeout:g} s) ...", file=sys.stderr, flush=True)
        time.sleep(args.minutes * 60)
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            errors = list(pool.map(lambda c: _forward_error(c, datum), clients))
        final_s = time.monotonic() - started
        with sqlite3.connect(live.data_dir / "skyrl_tx.db") as db:
            statuses = dict(db.execute("SELECT status, COUNT(*) FROM models GROUP BY status").fetchall())
        for service in services:
            service.close("success").result()
    report = {"sessions": args.sessions, "idle_minutes": args.minutes, "models_by_status": statuses,
              "failed_calls": sum(e is not None for e in errors), "first_error": next((e for e in errors if e), None),
              "final_round_s": final_s, "heartbeats_per_s": args.sessions / 10.0}
    print(json.dumps(report, indent=2))
    return report


def _forward_error(client: Any, datum: Any) -> str | None:
    try:
        client.forward([datum], "cross_entropy").result()
        return None
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the bench counts them
        return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    run_idle_sessions(sys.argv[1:])
