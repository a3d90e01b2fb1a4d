"""Optimizer choice at create_model / load and the per-step optimizer params: parsing, checks, the job's form."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from skyrl_tx.api.validation import check_adam, check_finite
from skyrl_tx.db.models import ModelRecord
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import AdamParams, DimuonParams

# The families this server implements, with the optimizer_config the SDK sends (and get_info reports) for each.
OPTIMIZER_CONFIGS = {"adamw": {"type": "adamw"}, "dimuon": {"type": "dimuon", "version": 1}}
DIMUON_FIELDS = tuple(f.name for f in dataclasses.fields(DimuonParams))


def optimizer_kind(config: dict[str, Any] | None, what: str, field: str = "optimizer_config") -> str:
    """The family an optimizer_config names ("adamw" when absent); a user error naming the field otherwise."""
    if config is None:
        return "adamw"
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"{what}: {field} must be an object like {{\"type\": \"adamw\"}}")
    kind = config.get("type", "adamw")
    if kind not in OPTIMIZER_CONFIGS:
        raise InvalidArgumentError(f"{what}: {field}.type {kind!r} is not supported; use one of "
                                   f"{', '.join(OPTIMIZER_CONFIGS)}")
    extra = sorted(set(config) - set(OPTIMIZER_CONFIGS[kind]))
    if extra:
        raise InvalidArgumentError(f"{what}: {field} has unknown field(s) {extra} for {kind}")
    if kind == "dimuon" and config.get("version", 1) != 1:
        raise InvalidArgumentError(f"{what}: {field}.version {config.get('version')!r} is not supported; "
                                   "this server implements dimuon version 1")
    return kind


def model_optimizer(lora_config: dict[str, Any] | None) -> str:
    """A model's family, kept in its record's lora_config (models created before Dimuon existed: adamw)."""
    return (lora_config or {}).get("optimizer", "adamw")


def stored_optimizer(db: Connection | Session, model_id: str) -> str:
    return model_optimizer(db.execute(select(ModelRecord.lora_config).where(ModelRecord.id == model_id)).scalar())


def optim_job(model_id: str, kind: str, adam: AdamParams | None, params: dict[str, Any] | None) -> dict[str, Any]:
    """The optim_step job for a model of family `kind`: AdamW takes adam_params, Dimuon optimizer_params of type
    dimuon. Params of the other family are a user error naming the field the model needs."""
    if kind == "adamw":
        if adam is None:
            sent = (params or {}).get("type", "unknown") if isinstance(params, dict) else "unknown"
            raise InvalidArgumentError(f"optim_step: model {model_id} uses the adamw optimizer (chosen at "
                                       f"create_model); send adam_params (AdamParams), not optimizer_params of "
                                       f"type {sent!r}")
        check_adam(adam)
        return {"model_id": model_id, "adam_params": dataclasses.asdict(adam)}
    if adam is not None or params is None:
        raise InvalidArgumentError(f"optim_step: model {model_id} uses the {kind} optimizer (chosen at "
                                   f"create_model); send optimizer_params (DimuonParams), not adam_params")
    return {"model_id": model_id, "optimizer_params": check_dimuon(params)}


def check_dimuon(params: Any, what: str = "optim_step") -> dict[str, Any]:
    """DimuonParams as the SDK sends them, checked: numbers, finite, learning_rate >= 0, beta1 in [0, 1)."""
    if not isinstance(params, dict) or params.get("type", "dimuon") != "dimuon":
        sent = params.get("type") if isinstance(params, dict) else params
        raise InvalidArgumentError(f"{what}: optimizer_params.type must be 'dimuon' for this model (got {sent!r})")
    extra = sorted(set(params) - {"type", *DIMUON_FIELDS})
    if extra:
        raise InvalidArgumentError(f"{what}: optimizer_params has unknown field(s) {extra}; dimuon takes "
                                   f"{', '.join(DIMUON_FIELDS)}")
    if "learning_rate" not in params:
        raise InvalidArgumentError(f"{what}: optimizer_params.learning_rate is required")
    defaults = DimuonParams()
    out: dict[str, Any] = {"type": "dimuon"}
    for name in DIMUON_FIELDS:
        value = params.get(name, getattr(defaults, name))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentError(f"{what}: optimizer_params.{name} must be a number (got {value!r})")
        check_finite(value, f"optimizer_params.{name}", what)
        out[name] = float(value)
    if out["learning_rate"] < 0:
        raise InvalidArgumentError(f"{what}: optimizer_params.learning_rate must be >= 0 (got {out['learning_rate']})")
    if not 0 <= out["beta1"] < 1:
        raise InvalidArgumentError(f"{what}: optimizer_params.beta1 must be in [0, 1) (got {out['beta1']})")
    return out
