#!/usr/bin/env bash
# GPU checks on a machine with a CUDA device (CI has none): builds the extension's CUDA path for this GPU,
# then runs the gpu-labelled GoogleTests, the gpu-marked pytest tests and, with --bench, the GPU benchmark.
#   tests/gpu/run_on_gpu.sh [--no-build] [--bench "<bench args>"]... [OUT_DIR]
# Each --bench runs `python -m skyrl_tx.bench --device cuda <bench args>` (report: OUT_DIR/bench-gpu-N.json); one
# naming a mode first (e.g. --bench "packing --reps 3") runs `python -m skyrl_tx.bench <mode> ... --device cuda`
# (report: the last line of OUT_DIR/bench-gpu-N.out, its summary in OUT_DIR/bench-N.log).
# Uses the python3 on PATH (it must hold torch 2.11.0 with CUDA, transformers, peft, pytest); installs nothing.
# Without network, point SKYRL_TX_GTEST_SOURCE at a googletest source tree or .tar.gz (/usr/src/googletest).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=1 BENCHES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) BUILD=0; shift ;;
    --bench) BENCHES+=("$2"); shift 2 ;;
    *) break ;;
  esac
done
OUT=${1:-${OUT:-/tmp/skyrl_tx-gpu}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
step() { printf '\n==> %s (%ss)\n' "$1" "$SECONDS"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

if [ "$BUILD" = 1 ]; then
  step "build (CUDA path, GoogleTests)"
  gtest=()
  if [ -n "${SKYRL_TX_GTEST_SOURCE:-}" ]; then
    src=$SKYRL_TX_GTEST_SOURCE
    if [ -f "$src" ]; then mkdir -p build/gtest-src && tar xzf "$src" -C build/gtest-src && src=$PWD/build/gtest-src/googletest; fi
    gtest=(-DFETCHCONTENT_SOURCE_DIR_GOOGLETEST="$src")
  fi
  arch=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")
  # Where g++ has no libstdc++.so linker symlink (only libstdc++.a, as on one GPU image), -lstdc++ links the
  # static archive and the module gets its own copy of the iostream locale state: its first std::ostringstream
  # use crashes. Point the linker at the shared runtime.
  libdirs=()
  runtime=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  if [ -n "$runtime" ]; then
    mkdir -p build/gpu-libs && ln -sf "$runtime" build/gpu-libs/libstdc++.so
    libdirs=(-DCMAKE_MODULE_LINKER_FLAGS="-L$PWD/build/gpu-libs" -DCMAKE_SHARED_LINKER_FLAGS="-L$PWD/build/gpu-libs"
             -DCMAKE_EXE_LINKER_FLAGS="-L$PWD/build/gpu-libs")
    echo "linking the shared C++ runtime $runtime ($(command -v g++): $(g++ -print-file-name=libstdc++.so))"
  fi
  rm -rf build/gpu
  cmake -S . -B build/gpu -G Ninja -DCMAKE_CXX_COMPILER="$(command -v g++)" -DPython_EXECUTABLE="$(command -v "$PY")" -DSKYRL_TX_WITH_CUDA=ON \
    -DSKYRL_TX_BUILD_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" "${gtest[@]}" "${libdirs[@]}" >"$OUT/cmake.log"
  cmake --build build/gpu --target _C test_kernels -j "$(nproc)" >>"$OUT/cmake.log"
  # Refuse a module that still carries its own libstdc++ (see above).
  if ! readelf -d build/gpu/csrc/_C*.so | grep -q 'libstdc++'; then
    echo "error: _C links libstdc++ statically; its link command:" >&2
    ninja -C build/gpu -t commands csrc/$(basename build/gpu/csrc/_C*.so) | tail -n 1 >&2
    ls -l /usr/bin/g++* /opt/gcc/lib64/libstdc++* 2>&1 | head >&2; g++ -dumpspecs | grep -n -i -B1 -A2 'stdc++' >&2
    exit 1
  fi
  # The module and its build record beside the sources: PYTHONPATH=. imports them without an install.
  cp build/gpu/csrc/_C*.so build/gpu/csrc/_build_info.py skyrl_tx/
  cp build/gpu/csrc/_C*.so build/gpu/csrc/_build_info.py "$OUT/"
fi
"$PY" -c "from skyrl_tx import _build_info as b; assert b.WITH_CUDA, 'built without the CUDA path'; print('extension:', b.__dict__.get('TORCH_VERSION'))"

status=0
if [ "$BUILD" = 1 ]; then
  step "GoogleTests on the GPU"
  for t in test_kernels; do
    build/gpu/tests/cpp/$t --gtest_brief=1 2>&1 | tail -n 5 || status=1
  done
fi

step "pytest -m gpu"
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider >"$OUT/pytest-gpu.log" 2>&1 || status=1
grep -vE '^  File|^Extension modules' "$OUT/pytest-gpu.log" | tail -n 25

for i in "${!BENCHES[@]}"; do
  step "benchmark $i: ${BENCHES[$i]}"
  read -r first _ <<<"${BENCHES[$i]}"
  if [[ -n "$first" && "$first" != -* && "$first" != compute ]]; then
    # A mode (packing, mixed, weight-sync, ...): its summary goes to stderr, its JSON report is stdout's last line.
    # shellcheck disable=SC2086
    "$PY" -m skyrl_tx.bench ${BENCHES[$i]} --device cuda >"$OUT/bench-gpu-$i.out" 2>"$OUT/bench-$i.log" \
      || status=1
    grep -vE '^  File' "$OUT/bench-$i.log" | tail -n 30 || true
  else
    # shellcheck disable=SC2086
    "$PY" -m skyrl_tx.bench --device cuda --json "$OUT/bench-gpu-$i.json" ${BENCHES[$i]} 2>"$OUT/bench-$i.log" \
      || { status=1; grep -vE '^  File' "$OUT/bench-$i.log" | tail -n 30; }
  fi
done
step "done (status $status)"
exit $status
