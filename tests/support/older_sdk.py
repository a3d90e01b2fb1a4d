"""The tinker SDK 0.25.0 (the version other open servers pin) beside the installed one, for the compatibility tests.

tests/run_all.sh installs it with `pip install --no-deps --target` into a directory outside the checkout and names
that directory in $SKYRL_TX_OLD_SDK_DIR; a script runs against it with that directory first on its PYTHONPATH.
Its dependencies are the installed SDK's (the same packages, older lower bounds).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

OLD_SDK_VERSION = "0.25.0"
ENV_VAR = "SKYRL_TX_OLD_SDK_DIR"


def older_sdk_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with tinker 0.25.0 first on the path, after checking that a script really imports that version.
    Without the directory: a skip, except under CI=true, where it is a failure."""
    directory = os.environ.get(ENV_VAR, "")
    if not directory or not (Path(directory) / "tinker").is_dir():
        message = (f"tinker {OLD_SDK_VERSION} is not installed for the compatibility tests: "
                   f"pip install --no-deps --target DIR tinker=={OLD_SDK_VERSION}, then set {ENV_VAR}=DIR "
                   "(tests/run_all.sh does both)")
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(message)
        pytest.skip(message)
    paths = [directory, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**env, "PYTHONPATH": os.pathsep.join(paths)}
    version = subprocess.run([sys.executable, "-c", "import tinker; print(tinker.__version__)"], env=env,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    assert version == OLD_SDK_VERSION, f"{directory} gives tinker {version!r}, not {OLD_SDK_VERSION}"
    return env
