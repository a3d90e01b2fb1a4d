"""`python -m skyrl_tx.bench.bodies`: the harness reports every stage, and binary bodies keep a large
forward_backward's server CPU far below what JSON bodies cost (a peer measurement in the same test, no absolute
timing)."""

from __future__ import annotations

import json
import math
import time

from skyrl_tx.bench import bodies
from skyrl_tx.db.models import request_hash
from skyrl_tx.wire.codec import decode_forward_backward_request


def test_bodies_bench_reports_every_stage(tmp_path) -> None:
    report = bodies.main(["--datums", "2", "--tokens", "64", "--reps", "1", "--json", str(tmp_path / "r.json")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["stages_cpu_ms"]) == set(report["stages_cpu_ms"]) and len(saved["stages_cpu_ms"]) == 10
    assert set(bodies.REQUEST_STAGES) <= set(saved["stages_cpu_ms"])
    assert all(math.isfinite(v) and v >= 0 for v in saved["stages_cpu_ms"].values())
    assert saved["body_bytes"] > 2 * 64 * (4 + 8 + 4) and saved["result_bytes"] > 2 * 64 * (4 + 4)


def test_binary_request_path_costs_less_than_hashing_the_same_datums_as_json() -> None:
    # 16 x 4,096 tokens: the whole binary request path (decode, hash, store, scan, load, tensors) against one
    # step of the JSON one (the canonical JSON hash of the decoded datums), in CPU time of this process.
    got = bodies.measure(16, 4096, reps=3)
    decoded = decode_forward_backward_request(bodies._sdk_body(16, 4096), None)
    as_json = [{"input_tokens": d["input_tokens"].tolist(),
                "loss_fn_inputs": {k: {**t, "values": t["values"].tolist()} for k, t in d["loss_fn_inputs"].items()}}
               for d in decoded["data"]]
    start = time.process_time()
    request_hash({"data": as_json})
    json_hash_ms = (time.process_time() - start) * 1e3
    assert got["request_path_cpu_ms"] < json_hash_ms, (got, json_hash_ms)
