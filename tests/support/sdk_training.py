"""SDK-side helpers of the checkpoint tests: step-dependent SFT steps, server logprobs, signed-URL downloads."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types

TOKENS = list(range(5, 37))


def datum(offset: int) -> types.Datum:
    tokens = [t + offset for t in TOKENS]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def train_step(client: tinker.TrainingClient, step: int, adam: types.AdamParams) -> float:
    """One SFT step on a step-dependent batch; returns the summed loss."""
    result = client.forward_backward([datum(step), datum(step + 7)], "cross_entropy").result()
    client.optim_step(adam).result()
    return float(sum(-np.asarray(out["logprobs"].tolist()).sum() for out in result.loss_fn_outputs))


def server_logprobs(client: tinker.TrainingClient, tokens: list[int]) -> torch.Tensor:
    out = client.forward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                      loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})],
                         "cross_entropy").result()
    return torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist())


def download(urls: dict[str, str], dest: Path) -> Path:
    """Every file of a checkpoint through its signed URLs (what `tinker checkpoint download` does)."""
    dest.mkdir(parents=True)
    for name, url in urls.items():
        with urllib.request.urlopen(url) as response:
            (dest / name).write_bytes(response.read())
    return dest


def token_datum(tokens: list[int], **inputs) -> types.Datum:
    """A next-token datum over `tokens` (weights 1), with extra or replaced loss_fn_inputs."""
    loss_fn_inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1), **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_fn_inputs)
