#!/usr/bin/env bash
# Run the peer decode benchmarks on the GPU machine (from any directory).
#
#   bash benches/peers/run_on_device.sh --out "$OUT/peers-h100.json" [peers.py flags...]
#
# Needs .whl/ (and .whl-numpy/ if the image lacks numpy) carried from the dev
# machine: build them with benches/peers/slim_wheels.sh.  Installs into
# $PEERS_SITE (default /tmp/site) once per wheel set (a stamp file skips the
# reinstall on a warm machine); FlashInfer's JIT cache lives in
# $FLASHINFER_WORKSPACE_BASE (default /tmp/flashinfer-ws) and survives while the
# machine stays warm.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
SITE=${PEERS_SITE:-/tmp/site}

shopt -s nullglob
core=(.whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl)
if [ ${#core[@]} -lt 2 ]; then
  echo "run_on_device.sh: .whl/ lacks the flashinfer / tvm-ffi wheels (carry .whl; build it with benches/peers/slim_wheels.sh)" >&2
fi
wheels=("${core[@]}")
# import-time deps of flashinfer: install only those the image lacks, so the
# image's own versions are not shadowed
add_if_missing() {  # module wheel-glob
  if ! "$PY" -c "import $1" 2>/dev/null; then
    local w=($2)
    if [ ${#w[@]} -gt 0 ]; then wheels+=("${w[@]}"); else echo "WARNING: python module '$1' missing and no wheel for it ($2): flashinfer may fail to import" >&2; fi
  fi
}
add_if_missing packaging '.whl/packaging-*.whl'
add_if_missing requests '.whl/requests-*.whl'
add_if_missing urllib3 '.whl/urllib3-*.whl'
add_if_missing idna '.whl/idna-*.whl'
add_if_missing certifi '.whl/certifi-*.whl'
add_if_missing tqdm '.whl/tqdm-*.whl'
add_if_missing pynvml '.whl/nvidia_ml_py-*.whl'
add_if_missing numpy '.whl-numpy/numpy-*.whl .whl/numpy-*.whl'
command -v ninja >/dev/null 2>&1 || wheels+=(.whl/ninja-*.whl)

stamp="$SITE/.kvforge-peers-stamp"
want=$(for w in "${wheels[@]}"; do sha256sum "$w"; done | sha256sum | cut -d' ' -f1)
if [ ${#wheels[@]} -gt 0 ] && [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing into $SITE: ${wheels[*]}"
  # one pip call: --target --upgrade replaces $SITE/bin wholesale on each call
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  echo "$want" > "$stamp"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:/usr/local/cuda/bin:$PATH"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-ws}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
# sourced with PEERS_INSTALL_ONLY=1 (benches/serve/on_device.sh): install and set the env only
if [ -n "${PEERS_INSTALL_ONLY:-}" ]; then return 0 2>/dev/null || exit 0; fi
echo "python $("$PY" -V 2>&1), nvcc $(nvcc --version 2>/dev/null | tail -1), ninja $(ninja --version 2>/dev/null || echo missing)"
exec "$PY" -u benches/peers/peers.py "$@"
