"""A recovery snapshot's views (Backend.state_views) are refused where experts are split over the data-parallel
ranks: each rank holds only its experts' LoRA rows, so views would record a part as the whole (Gloo, 2 processes)."""

from __future__ import annotations

import traceback
from typing import Any

from rank_reports import spawn_ranks
from split_parity import split_backend

PRESET = "tiny-qwen3-moe"


def _rank_main(model_dir: str, rank: int, world: int, port: int, out: Any) -> None:
    try:
        from skyrl_tx.errors import UnimplementedError

        backend = split_backend(model_dir, rank, world, 1, port, experts="dp")
        backend.create_model("a", lora_rank=4, alpha=8.0, seed=1)
        whole = {k: tuple(v.shape) for k, v in backend.trainable_state("a").items()}  # gathered: the whole shapes
        try:
            views, _ = backend.state_views("a")
            report: Any = {k: tuple(v.shape) for k, v in views.items()}
        except UnimplementedError as exc:
            report = f"refused: {exc}"
        out.put((rank, {"whole": whole, "views": report}))
    except Exception:  # noqa: BLE001 - the report carries it to the test
        out.put((rank, traceback.format_exc()))


def test_state_views_are_refused_when_experts_are_split_over_data_parallel_ranks(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir(PRESET))
    ranks = spawn_ranks(_rank_main, 2, lambda r, port, out: (model_dir, r, 2, port, out), 240.0, "experts over dp")
    for rank, got in ranks.items():
        assert isinstance(got, dict), f"rank {rank}:\n{got}"
        views = got["views"]
        if isinstance(views, dict):  # views of a part under a whole tensor's name: a torn recovery snapshot
            parts = {k: (views[k], s) for k, s in got["whole"].items() if views.get(k) != s}
            assert not parts, f"rank {rank}: views of parts (view, whole shape): {sorted(parts.items())[:3]}"
        else:
            assert "split over ranks" in views, views
