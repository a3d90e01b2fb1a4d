"""`python -m skyrl_tx.bench.bodies`: server CPU per large forward_backward outside the compute (request and result bodies).

Method: one request of `--datums` x `--tokens` (default 32 x 4,096 = 131,072 tokens: input tokens, int64 target
tokens, float32 weights), encoded by the tinker SDK as it sends it, goes through the server's own functions with a
real SQLite database in a temporary directory, each stage timed in CPU time (time.process_time, this process):
request path: the API decodes the body, hashes and stores it (api/submit.py), the engine scans the pending futures
and loads + decodes the claimed body into tensors (engine/executor.py); result path: the engine encodes a result
of the same size (logprobs and elementwise_loss, float32 per token) and stores it, reports it to the API process
(engine/process.py's line), and retrieve_future reads and renders it for the SDK (Accept: protobuf). The compute
itself, HTTP and the mark-running update (a few columns, any request size) are left out. Median over --reps.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from skyrl_tx.bench.report import write_json

TARGET_MS = 50.0  # issue 14: per request, API + engine, for each of the request and the result


def _sdk_body(datums: int, tokens: int) -> bytes:
    from tinker import types
    from tinker.proto import request_conv

    rng = np.random.default_rng(0)
    data = [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, 150_000, tokens).tolist()),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(rng.integers(0, 150_000, tokens)),
                                        "weights": types.TensorData.from_numpy(rng.random(tokens, dtype=np.float32))})
            for _ in range(datums)]
    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn="cross_entropy"), model_id="bench:train:0", seq_id=1)
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def _cpu_ms(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.process_time()
    out = fn()
    return out, (time.process_time() - start) * 1e3


def measure(datums: int, tokens: int, reps: int) -> dict[str, Any]:
    """Per-stage CPU milliseconds (median over reps) of one request of datums x tokens."""
    import torch
    from sqlalchemy import create_engine

    from skyrl_tx.api.routes import futures as futures_route
    from skyrl_tx.api.submit import submit_future
    from skyrl_tx.db import future_queries, migrate
    from skyrl_tx.db.models import ModelRecord, SessionRecord
    from skyrl_tx.engine import executor
    from skyrl_tx.engine.process import done_line, parse_done_line
    from skyrl_tx.types import TrainResult
    from skyrl_tx.wire.codec import decode_forward_backward_request

    body = _sdk_body(datums, tokens)
    data_dir = Path(tempfile.mkdtemp(prefix="skyrl_tx_bench_bodies_"))
    url = f"sqlite:///{data_dir / 'bench.db'}"
    migrate.upgrade(url)
    database = create_engine(url)
    with database.begin() as db:
        db.execute(SessionRecord.__table__.insert(), {"id": "bench"})
        db.execute(ModelRecord.__table__.insert(), {"id": "bench:train:0", "session_id": "bench",
                                                    "base_model": "tiny", "lora_rank": 8})
    api = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(wake_engine=lambda: None, database=database)),
                          state=SimpleNamespace(), scope={"state": {}})  # what submit_future reads of a request
    outputs = [{"logprobs": -torch.rand(tokens), "elementwise_loss": torch.rand(tokens)} for _ in range(datums)]
    stages: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        out, ms = _cpu_ms(fn)
        stages.setdefault(name, []).append(ms)
        return out

    for rep in range(reps):
        future_id = f"bench:train:0:{rep}"
        decoded = timed("api: decode body", lambda: decode_forward_backward_request(body, None))
        job = {"model_id": "bench:train:0", "loss_fn": decoded["loss_fn"], "loss_fn_config": decoded["loss_fn_config"]}

        def store() -> None:
            with database.connect() as db:
                submit_future(api, db, future_id=future_id, request_type="forward_backward", body=job,
                              model_id="bench:train:0", seq_id=rep, binary_body=decoded["body"])

        timed("api: hash + store", store)

        def scan() -> list[Any]:
            with database.connect() as db:
                return list(db.execute(future_queries.PENDING))

        rows = timed("engine: pending scan", scan)
        requests = timed("engine: load + decode into tensors", lambda: executor.train_requests(database, rows))
        assert sum(len(d.input_tokens) for d in requests[0].data) == datums * tokens
        result = timed("engine: encode result", lambda: executor.train_result(
            TrainResult(outputs, {"loss:sum": 1.0})))
        outcome = future_queries.FutureOutcome(future_id, "completed", "forward_backward", result, None)

        def finish() -> None:
            with database.begin() as db:
                db.execute(future_queries.FINISH, future_queries.finish_params([outcome], datetime.now(timezone.utc)))

        timed("engine: store result", finish)
        line = timed("engine: report (engine process)", lambda: done_line([outcome]))
        timed("api: read report", lambda: parse_done_line(line))
        loaded = timed("api: load result", lambda: futures_route._load(api, future_id))
        response = timed("api: render result", lambda: futures_route._render(loaded, futures_route.PROTOBUF))
        assert response.body == result
    database.dispose()
    shutil.rmtree(data_dir, ignore_errors=True)
    medians = {name: statistics.median(ms) for name, ms in stages.items()}
    request_path = sum(v for k, v in medians.items() if k in REQUEST_STAGES)
    return {"body_bytes": len(body), "result_bytes": len(result), "stages_cpu_ms": medians,
            "request_path_cpu_ms": request_path, "result_path_cpu_ms": sum(medians.values()) - request_path}


REQUEST_STAGES = ("api: decode body", "api: hash + store", "engine: pending scan", "engine: load + decode into tensors")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.bench.bodies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datums", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per datum")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    got = measure(args.datums, args.tokens, args.reps)
    print(f"\nforward_backward of {args.datums} x {args.tokens} tokens: body {got['body_bytes'] / 1e6:.2f} MB, "
          f"result {got['result_bytes'] / 1e6:.2f} MB; server CPU per request (median of {args.reps})\n")
    for name, ms in got["stages_cpu_ms"].items():
        print(f"  {name:40s} {ms:8.2f} ms")
    for path in ("request", "result"):
        value = got[f"{path}_path_cpu_ms"]
        print(f"  {path + ' path total':40s} {value:8.2f} ms (target <= {TARGET_MS:g} ms: "
              f"{'met' if value <= TARGET_MS else 'MISSED'})")
    report = {"benchmark": "bodies", "datums": args.datums, "tokens": args.tokens, "reps": args.reps,
              "method": __doc__.split("Method: ", 1)[1].strip().replace("\n", " "), **got,
              "targets": {f"{p}_path_cpu_ms": {"target": TARGET_MS, "value": got[f"{p}_path_cpu_ms"],
                                               "met": got[f"{p}_path_cpu_ms"] <= TARGET_MS}
                          for p in ("request", "result")}}
    if args.json:
        write_json(report, args.json)
    return report


if __name__ == "__main__":
    main()
