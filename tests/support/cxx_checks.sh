#!/usr/bin/env bash
# The C++ checks tests/run_all.sh runs in the background beside pytest, after pip has built and installed the module
# alone (`-Cbuild.targets=_C`): the GoogleTest executables in build/py, ctest, and the CPU-only build's sources that
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
  # module compiles too. Its GoogleTests would repeat the same CPU code paths. Only the sources that test
  # SKYRL_TX_WITH_CUDA compile differently without it, so only they are compiled (~1 min instead of ~4.5 min on 2
  # cores); a header that tests it would change its includers, and then everything is built.
  part "CPU-only build (build/cpu-only)"
  cmake -S . -B build/cpu-only -G Ninja -DPython_EXECUTABLE="$PY" -DSKYRL_TX_WITH_CUDA=OFF \
    -DSKYRL_TX_BUILD_TESTS=OFF -DSKYRL_TX_WERROR=ON >/dev/null
  if grep -rlq SKYRL_TX_WITH_CUDA csrc --include='*.h' --include='*.hpp' --include='*.cuh'; then
    cmake --build build/cpu-only --target _C -j "$JOBS"
  else
    mapfile -t guarded < <(grep -rl SKYRL_TX_WITH_CUDA csrc --include='*.cpp' | sed 's|^csrc/||')
    mapfile -t objects < <(ninja -C build/cpu-only -t targets all | cut -d: -f1 \
      | grep -F -f <(printf '/%s.o\n' "${guarded[@]}"))
    echo "compiling the ${#objects[@]} object(s) of the sources that test SKYRL_TX_WITH_CUDA: ${guarded[*]}"
    [ "${#objects[@]}" -ge "${#guarded[@]}" ] || { echo "not every guarded source has an object target"; exit 1; }
    ninja -C build/cpu-only -j "$JOBS" "${objects[@]}"
  fi
fi
part "done"
