#!/usr/bin/env bash
# The C++ checks tests/run_all.sh runs in the background beside pytest, after pip has built and installed the module
# alone (`-Cbuild.targets=_C`): the GoogleTest executable in build/py, ctest, and the CPU-only build's sources that
# differ (when the main build took the CUDA path). Why beside pytest: run first, in series, they held pytest back
# ~3 min on 2 cores; niced beside it, they take what pytest leaves (its processes' waits on their servers) and pytest
# starts at once (a cold local run: pytest at 259 s, these done 521 s later, the real-shape phase 381 s against 377).
# Env: PY (the venv's python), WITH_CUDA (1: the main build compiled the CUDA path), JOBS, SKYRL_TX_SKIP_CPU_ONLY_BUILD.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
part() { printf '==> %s (%ss into this step)\n' "$1" "$SECONDS"; }

part "GoogleTests: build (build/py)"
cmake --build build/py -j "$JOBS"

part "ctest (build/py)"
ctest --test-dir build/py --output-on-failure -L cpu -j "$JOBS"

if [ "${WITH_CUDA:-0}" = 1 ] && [ "${SKYRL_TX_SKIP_CPU_ONLY_BUILD:-0}" != 1 ]; then
  # The main build took the CUDA path (its tests run on the CPU); prove the CPU-only configuration of the core and the
  # module compiles too. Its GoogleTests would repeat the same CPU code paths. Only the sources that test a macro the
  # two configurations define differently (the CUDA and NCCL paths; SKYRL_TX_TESTING, the test build's fault
  # injection, which this release-like configuration leaves out) compile differently, so only they are compiled (~1
  # min instead of ~4.5 min on 2 cores), with the includers of a header that tests one.
  part "CPU-only build (build/cpu-only)"
  cmake -S . -B build/cpu-only -G Ninja -DPython_EXECUTABLE="$PY" -DSKYRL_TX_WITH_CUDA=OFF \
    -DSKYRL_TX_BUILD_TESTS=OFF -DSKYRL_TX_WERROR=ON -DSKYRL_TX_UNITY_BUILD=OFF >/dev/null
  differing='SKYRL_TX_WITH_CUDA|SKYRL_TX_WITH_NCCL|SKYRL_TX_TESTING'
  # The sources that test one, and those that include (directly or through other headers) a header that does.
  mapfile -t guarded < <("$PY" - "$differing" <<'PYEOF'
import pathlib, re, sys
root = pathlib.Path("csrc")
files = {p.relative_to(root).as_posix(): p.read_text(errors="replace")
         for p in root.rglob("*") if p.suffix in (".cpp", ".h", ".hpp", ".cuh")}
marked = {name for name, text in files.items() if re.search(sys.argv[1], text)}
while True:
    headers = [name for name in marked if not name.endswith(".cpp")]
    more = {name for name, text in files.items() if name not in marked
            and any(f'#include "{header}"' in text for header in headers)}
    if not more:
        break
    marked |= more
print("\n".join(sorted(name for name in marked if name.endswith(".cpp"))))
PYEOF
  )
  targets=$(ninja -C build/cpu-only -t targets all | cut -d: -f1)
  objects=() absent=()
  for source in "${guarded[@]}"; do
    object=$(grep -F "/$source.o" <<<"$targets" || true)
    if [ -n "$object" ]; then objects+=($object); else absent+=("$source"); fi
  done
  echo "compiling the ${#objects[@]} object(s) of the sources that compile differently ($differing, or a header" \
    "that tests one): ${guarded[*]}"
  [ "${#absent[@]}" = 0 ] || echo "not part of the CPU-only configuration: ${absent[*]}"
  [ "${#objects[@]}" -gt 0 ] || { echo "no object target found for: ${guarded[*]}"; exit 1; }
  ninja -C build/cpu-only -j "$JOBS" "${objects[@]}"
fi
part "done"
