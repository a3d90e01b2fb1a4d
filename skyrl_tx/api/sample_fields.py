"""The SDK 0.38 sampling fields at the edge: topk_sample_logprobs, prompt_alt_tokens_k, prompt_logprobs_last_n and
target_prompt_logprobs (dense or sparse CSR TensorData), checked and turned into the engine job's plain form.

Each bad value is an InvalidArgumentError naming the field and its valid range (a 400) before anything is stored;
the engine checks token ids against the vocabulary (csrc/sampling/prompt_scoring.cpp)."""

from __future__ import annotations

from typing import Any

from skyrl_tx.api.validation import INT64_MAX, check_int_range
from skyrl_tx.errors import InvalidArgumentError

# Columns of target_prompt_logprobs: ids scored per position (the cookbook's `decisions` asks one per label). Bounds
# the dense [len(prompt) - 1, K] matrix the engine builds from a sparse request.
MAX_TARGET_COLUMNS = 256


def sample_field_job(body: Any, prompt_len: int, max_logprobs_k: int, what: str = "asample") -> dict[str, Any]:
    """The job keys of the 0.38 fields `body` sets (none when it sets none)."""
    job: dict[str, Any] = {}
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        value = getattr(body, name)
        if value:
            check_int_range(value, name, 0, max_logprobs_k, what + " (max_logprobs_k in --backend-config sets the "
                                                                  "upper bound)")
            job[name] = value
    last_n = body.prompt_logprobs_last_n
    if last_n is not None:
        if not (body.prompt_logprobs or body.topk_prompt_logprobs):
            raise InvalidArgumentError(f"{what}: prompt_logprobs_last_n applies to prompt logprobs; set "
                                       "prompt_logprobs (or topk_prompt_logprobs) too, or leave it unset")
        check_int_range(last_n, "prompt_logprobs_last_n", 1, max(prompt_len - 1, 1), what)
        if prompt_len < 2:
            raise InvalidArgumentError(f"{what}: prompt_logprobs_last_n needs a prompt of at least 2 tokens")
        job["prompt_logprobs_last_n"] = last_n
    if body.target_prompt_logprobs is not None:
        job["target_prompt_logprobs"] = target_ids(body.target_prompt_logprobs, prompt_len, what)
    if getattr(body, "record_stability_info", None):  # the future is the record (api/provenance.py)
        job["record_stability_info"] = True
    return job


def target_ids(tensor: Any, prompt_len: int, what: str) -> dict[str, Any]:
    """target_prompt_logprobs as TensorData JSON -> {"ids": dense [P - 1][K] with -1 = none, "sparse": CSR indices
    or None}. The result keeps the request's layout, so a sparse request's indices travel with the job."""
    name = "target_prompt_logprobs"
    if not isinstance(tensor, dict):
        raise InvalidArgumentError(f"{what}: {name} must be a TensorData object (data, dtype, shape)")
    if tensor.get("dtype") != "int64":
        raise InvalidArgumentError(f"{what}: {name} must be an int64 tensor of token ids (got dtype "
                                   f"{tensor.get('dtype')!r})")
    rows = prompt_len - 1
    shape = tensor.get("shape")
    if (not isinstance(shape, list) or len(shape) != 2 or not all(isinstance(d, int) and not isinstance(d, bool)
                                                                  for d in shape)
            or shape[0] != rows or not 1 <= shape[1] <= MAX_TARGET_COLUMNS):
        raise InvalidArgumentError(f"{what}: {name} must have shape [len(prompt) - 1, K] = [{rows}, K] with K in "
                                   f"[1, {MAX_TARGET_COLUMNS}] (got {shape!r})")
    if rows < 1:
        raise InvalidArgumentError(f"{what}: {name} needs a prompt of at least 2 tokens")
    cols = shape[1]
    data = tensor.get("data")
    if not isinstance(data, list):
        raise InvalidArgumentError(f"{what}: {name}.data must be a list of token ids")
    for i, value in enumerate(data):
        check_int_range(value, f"{name}.data[{i}]", -1, INT64_MAX, what + " (-1 asks for nothing)")
    crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
    if crow is None and col is None:
        if len(data) != rows * cols:
            raise InvalidArgumentError(f"{what}: {name} has {len(data)} values for shape [{rows}, {cols}] "
                                       f"(dense: {rows * cols})")
        return {"ids": [data[r * cols:(r + 1) * cols] for r in range(rows)], "sparse": None}
    _check_csr(crow, col, rows, cols, len(data), what)
    ids = [[-1] * cols for _ in range(rows)]
    for r in range(rows):
        for i in range(crow[r], crow[r + 1]):
            ids[r][col[i]] = data[i]
    return {"ids": ids, "sparse": {"crow_indices": crow, "col_indices": col}}


def _check_csr(crow: Any, col: Any, rows: int, cols: int, nnz: int, what: str) -> None:
    name = "target_prompt_logprobs"
    if not isinstance(crow, list) or not isinstance(col, list):
        raise InvalidArgumentError(f"{what}: {name}: sparse_crow_indices and sparse_col_indices go together "
                                   "(both lists, or neither)")
    ok = (len(crow) == rows + 1 and len(col) == nnz and all(isinstance(v, int) and not isinstance(v, bool)
                                                             for v in crow + col)
          and crow[0] == 0 and crow[-1] == nnz and all(a <= b for a, b in zip(crow, crow[1:])))
    if not ok:
        raise InvalidArgumentError(f"{what}: {name} is not valid CSR for shape [{rows}, {cols}] with {nnz} values "
                                   f"(crow_indices: {rows + 1} non-decreasing entries from 0 to {nnz}; col_indices: "
                                   f"{nnz} entries)")
    for r in range(rows):
        row_cols = col[crow[r]:crow[r + 1]]
        if any(not 0 <= c < cols for c in row_cols) or len(set(row_cols)) != len(row_cols):
            raise InvalidArgumentError(f"{what}: {name} row {r} lists a column outside [0, {cols}) or twice")
