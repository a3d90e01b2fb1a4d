"""bfloat16 full fine-tuning keeps float32 master weights beside the AdamW moments (csrc/optim/adamw.h): an update
below half a bf16 ulp accumulates in the master instead of being rounded away each step, so a bf16 run's weights
follow the float32 run's. The masters travel with the optimizer state through a checkpoint's files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skyrl_tx.backend.native import NativeBackend
from skyrl_tx.checkpoints import formats
from skyrl_tx.config import BackendSettings
from skyrl_tx.types import AdamParams, Datum, TrainRequest

# The tiny preset's matrices are 0.02·N(0, 1). Each step moves a weight by at most ~LR; for |w| >= 2^-6 that is
# below half a bf16 ulp (>= 6.1e-5), so without masters those weights never move. STEPS steps move them ~2e-3,
# 2+ ulps where |w| < 2^-3: visible after rounding.
STEPS, LR = 50, 4e-5
LOST_FROM, VISIBLE_BELOW = 2.0 ** -6, 2.0 ** -3


def train(backend: NativeBackend, model_id: str, steps: int, seed: int = 0) -> None:
    """`steps` AdamW steps, each on the same two sequences (cross-entropy)."""
    vocab = backend.decoder_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (17,), generator=gen) for _ in range(2)]
    request = TrainRequest(model_id, [Datum(r[:-1], {"target_tokens": r[1:], "weights": torch.ones(16)})
                                      for r in rows])
    for _ in range(steps):
        backend.forward_backward([request])
        backend.optim_step(model_id, AdamParams(learning_rate=LR))


def displacement(start: dict[str, torch.Tensor], final: dict[str, torch.Tensor],
                 masks: dict[str, torch.Tensor]) -> torch.Tensor:
    """final - start over the masked elements of every tensor, flattened into one vector."""
    return torch.cat([(final[k] - start[k])[masks[k]] for k in sorted(masks)])


def sub_ulp_masks(bf16_start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights whose per-step update is below half a bf16 ulp and whose STEPS-step move is above one."""
    return {k: (v.abs() >= LOST_FROM) & (v.abs() < VISIBLE_BELOW) for k, v in bf16_start.items()}


def run(model_dir: Path, dtype: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    backend = NativeBackend(model_dir, BackendSettings(dtype=dtype, max_lora_adapters=1, max_lora_rank=4))
    backend.create_model("full", lora_rank=0)
    start = backend.trainable_state("full")
    train(backend, "full", STEPS)
    return start, backend.trainable_state("full")


def assert_follows_float32(bf16: tuple[dict, dict], f32: tuple[dict, dict]) -> None:
    """Over the sub-ulp-update weights: the bf16 run moved as the float32 run did, up to bf16 rounding (its gradients
    come from bf16 compute, so not bit for bit). Without master weights they stay put (measured: 0.2% moved)."""
    masks = sub_ulp_masks(bf16[0])
    n = int(sum(m.sum() for m in masks.values()))
    assert n > 10_000, n  # most of the model's matrices
    ours, reference = displacement(*bf16, masks), displacement(*f32, masks)
    start = torch.cat([bf16[0][k][masks[k]] for k in sorted(masks)])
    # The float32 run's move as a bf16 weight shows it: many weights' net move is under half an ulp.
    predicted = (start + reference).to(torch.bfloat16).float() - start
    moved, predicted_moved = float((ours != 0).float().mean()), float((predicted != 0).float().mean())
    ratio = float(ours.norm() / reference.norm())
    near = float(((ours - predicted).abs() <= 1e-3).float().mean())  # within one ulp at the mask's top
    assert predicted_moved > 0.3, predicted_moved
    assert moved > 0.9 * predicted_moved, f"{moved:.1%} of {n} sub-ulp-update weights moved ({predicted_moved:.1%} " \
                                          "in the float32 run)"
    assert 0.9 < ratio < 1.1, f"bf16 moved {ratio:.3f}x as far as float32 over {n} weights"
    assert near > 0.99, f"{1 - near:.2%} of {n} weights ended over an ulp from the float32 run's rounding"


@pytest.fixture(scope="module")
def float32_run(tiny_model_dir) -> tuple[dict, dict]:
    return run(tiny_model_dir("tiny-qwen3"), "float32")


def test_bf16_full_finetune_follows_the_float32_trajectory(tiny_model_dir, float32_run) -> None:
    assert_follows_float32(run(tiny_model_dir("tiny-qwen3"), "bfloat16"), float32_run)


def test_master_weights_round_trip_through_checkpoint_files(tiny_model_dir) -> None:
    """optimizer.safetensors holds the masters; restored after the (bf16) weights into a fresh model, training goes
    on bit for bit as the original's. Without them (a checkpoint from before masters) they are rebuilt from the
    loaded weights."""
    settings = BackendSettings(dtype="bfloat16", max_lora_adapters=1, max_lora_rank=4, max_full_models=3)
    backend = NativeBackend(tiny_model_dir("tiny-qwen3"), settings)
    backend.create_model("a", lora_rank=0)
    train(backend, "a", 3)
    state = backend.optimizer_state("a")
    weights = {k: v.to(torch.bfloat16) for k, v in backend.trainable_state("a").items()}  # as the weights file
    assert state.master.keys() == state.exp_avg.keys() == weights.keys()
    for name, master in state.master.items():
        assert master.dtype == torch.float32 and torch.equal(master.to(torch.bfloat16), weights[name]), name
    params = sum(m.numel() for m in state.master.values())
    assert backend.optimizer_state_bytes("a") == 3 * 4 * params  # exp_avg, exp_avg_sq, master
    raw = formats.optimizer_files(state)[formats.OPTIMIZER_FILE].to_bytes()
    saved = formats.read_optimizer(lambda name: raw)
    assert saved["master"].keys() == state.master.keys()

    backend.create_model("b", lora_rank=0)
    backend.set_trainable_state("b", weights)
    backend.restore_optimizer("b", saved)
    backend.create_model("old", lora_rank=0)  # a checkpoint written before master weights existed
    backend.set_trainable_state("old", weights)
    backend.restore_optimizer("old", {**saved, "master": {}})
    assert not backend.optimizer_state("old").master
    for model_id in ("a", "b", "old"):
        train(backend, model_id, 2, seed=1)
    a, b = backend.trainable_state("a"), backend.trainable_state("b")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert backend.optimizer_state("old").master.keys() == state.master.keys()  # rebuilt at its first step


def _zero_rank(model_dir: str, rank: int, world: int, port: int, out) -> None:
    """One data-parallel rank: a ZeRO-sharded bf16 full fine-tune (its master weights sharded with its moments)."""
    try:
        from skyrl_tx.parallel.group import RankAddress, join_group

        torch.set_num_threads(1)
        backend = NativeBackend(model_dir, BackendSettings(dtype="bfloat16", max_lora_adapters=1, max_lora_rank=4))
        backend.attach_collectives(join_group(RankAddress(f"127.0.0.1:{port}", rank, world), device="cpu",
                                              timeout_s=60))
        backend.create_model("full", lora_rank=0)
        start = backend.trainable_state("full")
        train(backend, "full", STEPS)
        state = backend.optimizer_state("full")  # collective: gathers every rank's master range
        final = backend.trainable_state("full")
        ok = all(torch.equal(m.to(torch.bfloat16).float(), final[k]) for k, m in state.master.items())
        out.put((rank, {"start": {k: v.numpy().copy() for k, v in start.items()},
                        "final": {k: v.numpy().copy() for k, v in final.items()},
                        "masters": sorted(state.master), "masters_round_to_weights": ok,
                        "state_bytes": backend.optimizer_state_bytes("full")}))
    except Exception:  # noqa: BLE001
        import traceback

        out.put((rank, traceback.format_exc()))


def test_zero_sharded_bf16_full_finetune_follows_the_float32_trajectory(tiny_model_dir, float32_run) -> None:
    from live_server import free_port
    from rank_reports import rank_context, rank_process

    world, model_dir = 2, str(tiny_model_dir("tiny-qwen3"))
    context = rank_context()
    out, port = context.Queue(), free_port()
    procs = [rank_process(context, _zero_rank, (model_dir, r, world, port, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, got in results.items():
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        as_tensors = {part: {k: torch.from_numpy(v) for k, v in got[part].items()} for part in ("start", "final")}
        assert_follows_float32((as_tensors["start"], as_tensors["final"]), float32_run)
        assert got["masters"] == sorted(as_tensors["final"]) and got["masters_round_to_weights"]
        params = sum(v.numel() for v in as_tensors["final"].values())
        # This rank's range (half the model, plus padding) of the two moments and the master, float32.
        assert 3 * 4 * params / world <= got["state_bytes"] < 3 * 4 * (params / world + 1), got["state_bytes"]
