"""Device capacities for the memory plan, and the start-up refusal of a layout whose plan cannot fit.

The refusal compares the plan's peak with a device's whole memory (a GPU's total, the host's MemTotal), not with what
happens to be free: a configuration is refused only when it could never fit, and the error names the key to change.
"""

from __future__ import annotations

import logging
from pathlib import Path

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.models.hf_config import DecoderConfig
from skyrl_tx.parallel.layout import trainer_ranks_on_node
from skyrl_tx.plan.memory import GiB, KNOBS, LABELS, MemoryPlan, plan_memory

log = logging.getLogger("skyrl_tx.plan")


def host_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_capacity(device: str) -> int | None:
    """A device's whole memory in bytes; None where it cannot be read (no torch, no such GPU)."""
    if device == "cpu":
        return host_memory_bytes()
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return int(torch.cuda.get_device_properties(index).total_memory)
    except Exception:  # noqa: BLE001 - a plan without capacities still prints
        return None


def capacities(plan: MemoryPlan) -> dict[str, int]:
    found = {}
    for device in {d.device for d in plan.devices}:
        cap = device_capacity(device)
        if cap is not None:
            found[device] = cap
    return found


def check_fits(config: DecoderConfig, settings: BackendSettings, capacity: dict[str, int] | None = None) -> MemoryPlan:
    """The plan, logged in one line; InvalidArgumentError (naming the largest line's keys) when a device cannot hold
    its peak. On the CPU every process of the layout on this host shares its memory, so their totals are added."""
    plan = plan_memory(config, settings)
    capacity = capacities(plan) if capacity is None else capacity
    by_device: dict[str, int] = {}
    for d in plan.devices:
        processes = 1  # a GPU device holds one rank; on the CPU every rank of this node is a process of its own
        if d.device == "cpu":
            processes = (trainer_ranks_on_node(settings) if d.role.startswith("trainer")
                         else settings.inference_engine_tensor_parallel_size)
        by_device[d.device] = by_device.get(d.device, 0) + d.total * processes
    log.info("memory plan (skyrl-tx plan shows each line): %s", ", ".join(
        f"{d.role} on {d.device} {d.total / GiB:.2f} GiB" for d in plan.devices))
    for device, need in by_device.items():
        cap = capacity.get(device)
        if cap is None or need <= cap:
            continue
        worst = next(d for d in plan.devices if d.device == device)
        key = worst.largest_adjustable()
        raise InvalidArgumentError(
            f"memory plan: {device} needs {need / GiB:.1f} GiB at the peak but has {cap / GiB:.1f} GiB; the largest "
            f"part is {LABELS[key]} ({worst.lines[key] / GiB:.1f} GiB): lower it through --backend-config "
            f"{KNOBS[key]}. `skyrl-tx plan --base-model ... --backend-config ...` prints every line")
    return plan


def snapshot_budget_bytes(config: DecoderConfig, settings: BackendSettings, *, default: int,
                          capacity: dict[str, int] | None = None) -> int:
    """Full fine-tuning snapshots' budget when snapshot_memory_mb is 0: the trainer device's memory less the plan's
    peak (`default` where the device's memory cannot be read)."""
    plan = plan_memory(config, settings)
    trainer = plan.devices[0]
    capacity = capacities(plan) if capacity is None else capacity
    cap = capacity.get(trainer.device)
    budget = default if cap is None else max(cap - trainer.total, 0)
    log.info("full fine-tuning snapshots: %.1f GiB of %s (%s)", budget / GiB, trainer.device,
             "snapshot_memory_mb" if cap is None else "what the memory plan leaves")
    return budget
