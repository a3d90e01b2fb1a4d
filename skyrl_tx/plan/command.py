"""`skyrl-tx plan`: the memory plan of a base model and --backend-config, per device, before anything is loaded."""

from __future__ import annotations

import argparse
import json

from skyrl_tx.config import BackendSettings


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("plan", help="print the memory each device needs at the peak (weights, LoRA slots, "
                            "optimizer state, KV cache, activations) for a base model and --backend-config")
    parser.add_argument("--base-model", required=True, help="preset name, local HF directory, hub id, or a published "
                        "model this project knows by name (e.g. Qwen/Qwen3-8B; no download needed)")
    parser.add_argument("--backend-config", default=None, help="the server's --backend-config JSON")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes per line and device)")
    parser.set_defaults(func=plan_command)


def _config_dict(name: str) -> dict:
    from skyrl_tx.plan.published import PUBLISHED

    if name in PUBLISHED:
        return PUBLISHED[name]
    from skyrl_tx.models.checkpoint import resolve_model_path

    return json.loads((resolve_model_path(name) / "config.json").read_text())


def plan_command(args: argparse.Namespace) -> int:
    from skyrl_tx.models.hf_config import decoder_config_from_dict
    from skyrl_tx.plan.capacity import capacities
    from skyrl_tx.plan.memory import plan_memory

    settings = BackendSettings.from_json(args.backend_config)
    plan = plan_memory(decoder_config_from_dict(_config_dict(args.base_model)), settings)
    capacity = capacities(plan)
    if args.json:
        print(json.dumps({"devices": [{"role": d.role, "device": d.device, "lines": d.lines, "total": d.total,
                                       "capacity": capacity.get(d.device)} for d in plan.devices]}, indent=2))
    else:
        print(plan.render(capacity))
    fits = all(d.total <= capacity.get(d.device, d.total) for d in plan.devices)
    return 0 if fits else 1
