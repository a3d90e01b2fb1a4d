#!/usr/bin/env bash
# The wheel as a user installs it: builds dist/skyrl_tx-*.whl from the already-configured build (build/py: only the
# packaging runs), installs it into a fresh venv with pip (no compiler, no CMake; torch==2.11.0 from the index, as
# pinned in the wheel), serves tiny-qwen3 from it outside the checkout and runs the quickstart against it with
# FutureWarnings as errors. Used by tests/run_all.sh (SKYRL_TX_SKIP_WHEEL_CHECK=1 skips it); the venv (~5 GB: torch
# and its CUDA libraries) is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${PY:-$ROOT/.venv/bin/python}
# The module only (the GoogleTests configured in build/py are not the wheel's, and tests/run_all.sh builds them later)
BUILD_ARGS=(${SKYRL_TX_WHEEL_BUILD_ARGS:--Cbuild-dir=build/py -Cbuild.targets=_C -Ccmake.define.SKYRL_TX_BUILD_TESTS=ON -Ccmake.define.SKYRL_TX_WERROR=ON})
WORK=$(mktemp -d "${TMPDIR:-/tmp}/skyrl_tx_wheel.XXXXXX")
SERVER_PID=""
cleanup() {  # never fails: the script's own status is the verdict
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK" || true
}
trap cleanup EXIT

# --build: only package dist/ (it runs the build in build/py, so nothing else may use build/py meanwhile); --check:
# only install and serve the wheel already in dist/ (network- and disk-bound: tests/run_all.sh runs it beside pytest).
MODE=${1:-all}
case "$MODE" in all|--build|--check) ;; *) echo "usage: $0 [--build|--check]" >&2; exit 2 ;; esac
if [ "$MODE" != --check ]; then
  rm -rf dist && "$PY" -m pip wheel -q . --no-build-isolation --no-deps -w dist "${BUILD_ARGS[@]}"
fi
WHEEL=$(ls dist/skyrl_tx-*.whl)
echo "wheel: $WHEEL ($(du -h "$WHEEL" | cut -f1))"
[ "$MODE" = --build ] && exit 0
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$WHEEL" "tinker==0.38.0"

PORT=$("$PY" -c "from skyrl_tx.ports import free_local_port; print(free_local_port())")
mkdir "$WORK/data"
cd "$WORK"  # nothing of the checkout on sys.path: the installed wheel serves
SKYRL_TX_DATA_DIR="$WORK/data" SKYRL_TX_CACHE_DIR="$WORK/data/cache" OMP_NUM_THREADS=1 \
  "$WORK/venv/bin/python" -m skyrl_tx.api --base-model tiny-qwen3 --port "$PORT" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
# Up to 10 minutes: under tests/run_all.sh it starts beside the C++ checks and pytest, which take both cores.
for _ in $(seq 600); do
  grep -q "engine ready" "$WORK/server.log" && break
  kill -0 "$SERVER_PID" 2>/dev/null || { tail -40 "$WORK/server.log"; exit 1; }
  sleep 1
done
grep -q "engine ready" "$WORK/server.log" || { tail -40 "$WORK/server.log"; exit 1; }
"$WORK/venv/bin/python" -c "import skyrl_tx, sys; assert '/venv/' in skyrl_tx.__file__, skyrl_tx.__file__"
# With faulthandler, as the tests run client scripts: the SDK transport's known abort at interpreter exit, after the
# script finished (tests/support/client_scripts.py), counts as a clean exit; any other failure fails the check.
rc=0
TINKER_BASE_URL="http://127.0.0.1:$PORT" TINKER_API_KEY=tml-wheel TINKER_TELEMETRY=0 STEPS=2 SEED=0 \
  timeout 600 "$WORK/venv/bin/python" -X faulthandler -W error::FutureWarning "$ROOT/examples/quickstart_pig_latin.py" \
  2>"$WORK/client.err" || rc=$?
cat "$WORK/client.err" >&2
"$WORK/venv/bin/python" "$ROOT/tests/support/client_scripts.py" "$rc" "$WORK/client.err" \
  || { echo "the quickstart failed (exit $rc)"; exit 1; }
echo "wheel check: the quickstart ran against $WHEEL installed in a fresh venv"
