"""The unmodified Pig Latin quickstart (examples/quickstart_pig_latin.py) against a live server, through the SDK."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from client_scripts import client_argv, exited_cleanly
from older_sdk import older_sdk_env

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
API_KEY = "tml-test"


@pytest.mark.parametrize("sdk", ["installed", "0.25.0"])
def test_pig_latin_quickstart_trains_and_samples(server_url: str, preset_cache: Path, sdk: str) -> None:
    """With the installed SDK and with tinker 0.25.0 (tests/support/older_sdk.py), unmodified."""
    env = {**os.environ, "TINKER_BASE_URL": server_url, "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0",
           "STEPS": str(STEPS), "LEARNING_RATE": "5e-3", "SKYRL_TX_CACHE_DIR": str(preset_cache)}
    if sdk != "installed":
        env = older_sdk_env(env)
    # SDK 0.38 idioms: a FutureWarning (a client-creation future used as the client) fails the run
    script = str(REPO / "examples" / "quickstart_pig_latin.py")
    result = subprocess.run(client_argv("-W", "error::FutureWarning", script), env=env, capture_output=True,
                            text=True, timeout=240, cwd=REPO)
    output = f"stdout:\n{result.stdout}\nstderr (tail):\n{result.stderr[-4000:]}"
    assert exited_cleanly(result.returncode, result.stderr), output

    losses = [float(x) for x in re.findall(r"^step \d+: loss per token (\S+)$", result.stdout, re.M)]
    assert len(losses) == STEPS, output
    assert all(x == x and x > 0 for x in losses), output  # finite, positive (no NaN)
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"

    after = result.stdout.split("Responses:\n", 1)
    assert len(after) == 2, output
    responses = re.findall(r"^\d+: (?:'.*'|\".*\")$", after[1], re.M)
    assert len(responses) == 8, output
