#!/usr/bin/env bash
# GPU machine: the decode-step append (issue 29) checked and timed. Build and carry first
# (benches/append/build.sh): .bin-append (Rust GPU tests), .whl-kvforge (wheel).
#   1. the Rust GPU tests: append_step == host append (byte-identical pages for dense,
#      integer and spherical targets; rotated within fp16 rounding and decode tolerance),
#      tails filling mid-step, new sequences, stale tail mirrors, out-of-pages, bad arguments;
#   2. Python: Cache.append_step against Cache.append per sequence (same decode), and the
#      time of one step's write both ways at batch 64, 8 kv heads, d 128 (issue 29's case).
# Writes $OUT/append-tests.log and $OUT/append-py.json. Expected runtime: about a minute
# (first NVRTC compiles included).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-/tmp/append-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/usr/local/cuda/lib64} KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kvforge-append}
status=0
if [ -x .bin-append/append_step_gpu ]; then
  .bin-append/append_step_gpu --ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/append-tests.log" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  echo "no .bin-append/append_step_gpu (run benches/append/build.sh and carry .bin-append)"; status=1
fi
if ls .whl-kvforge/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --target /tmp/py-append .whl-kvforge/*.whl || status=1
  PYTHONPATH=/tmp/py-append python3 benches/append/check.py "$OUT/append-py.json" || status=1
else
  echo "no wheel in .whl-kvforge (crates/kvforge-py/build-wheel.sh)"; status=1
fi
exit $status
