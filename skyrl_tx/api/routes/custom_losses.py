"""create_custom_loss (SDK 0.38 server-side custom losses): the API checks the graph's shape and size and stores it
as a future; the engine rebuilds it from the C++ allow-list (csrc/loss/custom_loss_ops.cpp), which refuses any
other operation by node name, and answers its loss_id. forward_backward(data, "custom", {"loss_id": ...}) then
runs it in the training pass (check_custom_loss_config, called by routes/training.py)."""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection, select

from skyrl_tx.api.deps import DbDep
from skyrl_tx.api.ownership import owned_session
from skyrl_tx.api.principal import CallerDep
from skyrl_tx.api.responses import BODY_ERRORS, RequestFuture, errors
from skyrl_tx.api.submit import submit_future
from skyrl_tx.api.validation import check_model_seq_id
from skyrl_tx.db.models import FutureRecord, FutureStatus
from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1")

MAX_INPUTS = 16  # the SDK's limit, logprobs included
MAX_NODES = 1024  # csrc/loss/custom_loss.h kMaxCustomLossNodes, plus the output node
NODE_OPS = ("placeholder", "call_function", "call_method", "output")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class CustomLossInputBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    rank: int


class CustomLossNodeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: str
    name: str
    target: str = Field(max_length=256)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CustomLossGraphBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal[1] = 1
    nodes: list[CustomLossNodeBody]


class CreateCustomLossBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    session_id: str
    custom_loss_seq_id: int
    name: str = Field(max_length=128)
    inputs: list[CustomLossInputBody]
    graph: CustomLossGraphBody


def _check_graph(body: CreateCustomLossBody) -> None:
    """What the API can check without the allow-list: sizes, names and ranks (the engine checks every operation)."""
    what = f"create_custom_loss: loss {body.name!r}"
    if not 1 <= len(body.inputs) <= MAX_INPUTS:
        raise InvalidArgumentError(f"{what}: inputs: {len(body.inputs)} given; logprobs and at most "
                                   f"{MAX_INPUTS - 1} loss_fn_inputs")
    if body.inputs[0].name != "logprobs" or body.inputs[0].rank != 1:
        raise InvalidArgumentError(f"{what}: inputs[0] must be logprobs of rank 1 ([T]; rank-2 target_tokens are "
                                   "not supported by this server)")
    for i, item in enumerate(body.inputs):
        if not INPUT_NAME.fullmatch(item.name) or item.rank not in (0, 1, 2):
            raise InvalidArgumentError(f"{what}: inputs[{i}] must be a lowercase name with rank 0, 1 or 2")
    if len({item.name for item in body.inputs}) != len(body.inputs):
        raise InvalidArgumentError(f"{what}: inputs: each name once")
    if len(body.graph.nodes) > MAX_NODES + 1:
        raise InvalidArgumentError(f"{what}: graph.nodes: {len(body.graph.nodes)} nodes; at most {MAX_NODES}")
    for node in body.graph.nodes:
        if node.op not in NODE_OPS:
            raise InvalidArgumentError(f"{what}: node {node.name!r} is a {node.op!r} node; a custom loss may only "
                                       "call torch/math/operator functions and tensor methods")
        if not NODE_NAME.fullmatch(node.name):
            raise InvalidArgumentError(f"{what}: graph.nodes: {node.name[:64]!r} is not a node name")
    output = [node for node in body.graph.nodes if node.op == "output"]
    if len(output) != 1 or body.graph.nodes[-1] is not output[0]:
        raise InvalidArgumentError(f"{what}: graph.nodes must end with one output node")
    metrics = output[0].args[0] if output[0].args else None
    items = metrics.get("tuple") if isinstance(metrics, dict) else metrics
    if isinstance(items, list) and len(items) == 2 and isinstance(items[1], dict):
        for key in (items[1].get("dict") or {}):
            if not METRIC_KEY.fullmatch(key):
                raise InvalidArgumentError(f"{what}: metric {key!r} must be named custom/<name>:sum or "
                                           "custom/<name>:mean in lowercase")


@router.post("/create_custom_loss", responses={**BODY_ERRORS, **errors(404, 409)})
def create_custom_loss(body: CreateCustomLossBody, request: Request, db: DbDep, who: CallerDep) -> RequestFuture:
    owned_session(db, body.session_id, who, f"create_custom_loss: session {body.session_id!r} not found; create "
                  "one with create_session")
    check_model_seq_id(body.custom_loss_seq_id, "create_custom_loss", "custom_loss_seq_id")
    _check_graph(body)
    job = {"name": body.name, "inputs": [item.model_dump() for item in body.inputs],
           "nodes": [node.model_dump() for node in body.graph.nodes]}
    future_id = submit_future(request, db, future_id=f"{body.session_id}:loss:{body.custom_loss_seq_id}",
                              request_type="create_custom_loss", body=job, session_id=body.session_id)
    return RequestFuture(request_id=future_id)


def check_custom_loss_config(db: Connection, config: dict[str, Any], session_id: str, what: str) -> str:
    """forward_backward's loss_fn_config for loss_fn "custom": exactly {"loss_id": <a loss this session created>}.
    Returns the loss_id."""
    loss_id = config.get("loss_id")
    if not isinstance(loss_id, str) or set(config) != {"loss_id"}:
        raise InvalidArgumentError(f"{what}: loss_fn 'custom' takes loss_fn_config {{'loss_id': ...}} only, the id "
                                   "ServiceClient.create_custom_loss returned")
    row = db.execute(select(FutureRecord.status, FutureRecord.session_id).where(
        FutureRecord.id == loss_id, FutureRecord.request_type == "create_custom_loss")).one_or_none()
    if row is None or row.session_id != session_id or row.status != FutureStatus.COMPLETED.value:
        raise InvalidArgumentError(f"{what}: loss_fn_config loss_id {loss_id!r} is not a custom loss of this "
                                   "session (losses belong to the session that created them); create it with "
                                   "ServiceClient.create_custom_loss")
    return loss_id
