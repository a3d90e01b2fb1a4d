"""Smoke test of `python -m skyrl_tx.bench saves` (tiny model, one round, no upload delay): both modes report their
alone and with-save times and every save completed (a failed request fails the run). No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 300


def test_saves_benchmark_reports_both_modes(preset_cache: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "skyrl_tx.bench", "saves", "--size", "tiny", "--rounds", "1",
                           "--upload-mb-s", "0", "--max-tokens", "8"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["modes"]) == {"background", "on-loop"}
    for mode in report["modes"].values():
        assert len(mode["alone_s"]) == len(mode["with_save_s"]) == 1 and "ratio" in mode
    assert report["checkpoint_mb"] > 0  # the last round's checkpoint was written and listed
