"""The core's custom-loss interpreter (_C.CustomLoss, csrc/loss/custom_loss*.cpp) against the reference: the same
function traced by the tinker SDK (torch.fx) and run by PyTorch. Loss, metrics and d loss / d logprobs must agree;
graphs outside the allow-list are refused naming the node."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from skyrl_tx._ext import load_extension
from skyrl_tx.errors import InvalidArgumentError


def clipped_ratio_with_kl(logprobs, sampling_logprobs, advantages):  # the docs' example shape: PPO-style + KL
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    pg = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    kl = (ratio - 1 - (logprobs - sampling_logprobs)).mean()
    return pg + 0.1 * kl, {"custom/kl:mean": kl, "custom/pg:sum": pg}


def indexing_and_shapes(logprobs, weights):
    n = logprobs.shape[0]
    tail = logprobs[1:] * weights[1:]
    first = logprobs[0] * 2.0
    loss = -(tail.sum() + first) / n
    return loss, {"custom/len:mean": torch.ones_like(loss) * logprobs.size(0), "custom/max:mean": logprobs.max()}


def reductions_over_dims(logprobs, target_distribution, scale):  # a rank-2 input and a scalar one
    mixed = logprobs.unsqueeze(-1) + torch.log_softmax(target_distribution, dim=-1)
    lse = torch.logsumexp(mixed, dim=-1)
    soft = F.softplus(-lse).mean(dim=0) * scale
    masked = torch.where(logprobs > -5.0, logprobs, torch.zeros_like(logprobs)).sum()
    return soft - 0.01 * masked, {"custom/soft:sum": soft}


def python_numbers(logprobs, advantages):
    k = math.sqrt(2.0)
    centered = advantages - advantages.mean()
    scaled = centered / (centered.abs().max() + 1e-6)
    loss = -(logprobs * scaled).sum() * k + (1.0 - logprobs.exp()).pow(2).mean()
    return loss, {"custom/k:sum": torch.ones_like(loss) * 2 ** 3}


CASES = [
    (clipped_ratio_with_kl, {"logprobs": 1, "sampling_logprobs": 1, "advantages": 1}),
    (indexing_and_shapes, {"logprobs": 1, "weights": 1}),
    (reductions_over_dims, {"logprobs": 1, "target_distribution": 2, "scale": 0}),
    (python_numbers, {"logprobs": 1, "advantages": 1}),
]


def _inputs(ranks: dict[str, int], n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, rank in ranks.items():
        if name == "logprobs":
            out.append(-torch.rand(n, generator=g) * 4)
        else:
            shape = [] if rank == 0 else [n] if rank == 1 else [n, 3]
            out.append(torch.randn(shape, generator=g))
    return out


def _compile(fn, ranks):
    handle = trace_loss(fn, ranks, "session")
    graph = encode_graph(handle).model_dump()
    loss = load_extension().CustomLoss.from_wire(handle.name, [i.name for i in handle.inputs],
                                                 [i.rank for i in handle.inputs], graph["nodes"])
    return handle, loss


@pytest.mark.parametrize("fn, ranks", CASES, ids=[fn.__name__ for fn, _ in CASES])
def test_interpreter_matches_the_traced_graph(fn, ranks) -> None:
    handle, loss = _compile(fn, ranks)
    for seed in range(3):
        inputs = _inputs(ranks, n=7 + seed, seed=seed)
        ours_lp = inputs[0].clone().requires_grad_(True)
        ref_lp = inputs[0].clone().requires_grad_(True)
        ours, ours_metrics = loss.evaluate([ours_lp, *inputs[1:]])
        ref, ref_metrics = handle.graph(ref_lp, *inputs[1:])
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        assert list(loss.metric_names) == list(ref_metrics)
        for got, want in zip(ours_metrics, ref_metrics.values()):
            torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-6, atol=1e-6)
        ours.backward()
        ref.backward()
        torch.testing.assert_close(ours_lp.grad, ref_lp.grad, rtol=1e-6, atol=1e-6)


def _graph(nodes: list[dict], inputs=(("logprobs", 1),)) -> object:
    return load_extension().CustomLoss.from_wire("hostile", [n for n, _ in inputs], [r for _, r in inputs], nodes)


PLACEHOLDER = {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}


def _output(ref: str) -> dict:
    return {"op": "output", "name": "output", "target": "output",
            "args": [{"tuple": [{"ref": ref}, {"dict": {}}]}], "kwargs": {}}


@pytest.mark.parametrize("node, named", [
    ({"op": "call_function", "name": "evil", "target": "builtins.eval", "args": ["1"], "kwargs": {}}, "evil"),
    ({"op": "call_function", "name": "sys_1", "target": "os.system", "args": ["ls"], "kwargs": {}}, "sys_1"),
    ({"op": "call_method", "name": "to_np", "target": "numpy", "args": [{"ref": "logprobs"}], "kwargs": {}}, "to_np"),
    ({"op": "call_function", "name": "dunder", "target": "getattr",
      "args": [{"ref": "logprobs"}, "__class__"], "kwargs": {}}, "dunder"),
    ({"op": "call_module", "name": "mod", "target": "linear", "args": [{"ref": "logprobs"}], "kwargs": {}}, "mod"),
    ({"op": "get_attr", "name": "captured", "target": "weight", "args": [], "kwargs": {}}, "captured"),
])
def test_operations_off_the_allow_list_are_refused_by_node(node: dict, named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"node '{named}'"):
        _graph([PLACEHOLDER, node, _output(node["name"])])


def test_references_and_inputs_are_checked() -> None:
    forward_ref = {"op": "call_function", "name": "early", "target": "torch.exp", "args": [{"ref": "later"}],
                   "kwargs": {}}
    with pytest.raises(InvalidArgumentError, match="no earlier node"):
        _graph([PLACEHOLDER, forward_ref, _output("early")])
    with pytest.raises(InvalidArgumentError, match="declared"):  # the graph reads one input, two are declared
        _graph([PLACEHOLDER, _output("logprobs")], inputs=(("logprobs", 1), ("advantages", 1)))
    with pytest.raises(InvalidArgumentError, match="at most 15 loss_fn_inputs"):
        _graph([PLACEHOLDER, _output("logprobs")], inputs=[("logprobs", 1)] + [(f"x{i}", 1) for i in range(16)])


def test_a_non_scalar_loss_is_the_clients_error() -> None:
    loss = _graph([PLACEHOLDER, {"op": "call_function", "name": "e", "target": "torch.exp",
                                 "args": [{"ref": "logprobs"}], "kwargs": {}}, _output("e")])
    with pytest.raises(InvalidArgumentError, match="scalar"):
        loss.evaluate([torch.zeros(3)])
