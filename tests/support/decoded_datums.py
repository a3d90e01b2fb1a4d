"""plain(): the datums skyrl_tx.wire.codec decodes, as plain lists to compare (test_protobuf_codec and _schema)."""

from __future__ import annotations

from typing import Any

import numpy as np


def plain(data: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decoded datums with their numpy arrays as lists, after checking the arrays' dtypes."""
    out = []
    for d in data:
        assert d["input_tokens"].dtype == np.int32
        inputs = {}
        for name, t in d["loss_fn_inputs"].items():
            assert t["values"].dtype == {"float32": np.float32, "int64": np.int64}[t["dtype"]] and t["values"].ndim == 1
            inputs[name] = {**t, "values": t["values"].tolist()}
        out.append({"input_tokens": d["input_tokens"].tolist(), "loss_fn_inputs": inputs})
    return out
