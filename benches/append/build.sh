#!/usr/bin/env bash
# CPU machine: builds what benches/append/on_device.sh carries to the GPU machine.
#   .bin-append/append_step_gpu   the Rust GPU tests of KvCache::append_step (debug info
#                                 stripped; a few MiB)
#   .whl-kvforge/*.whl            the Python wheel (crates/kvforge-py/build-wheel.sh), unless
#                                 SKIP_WHEEL=1
# Carry: .bin-append and .whl-kvforge (well under 64 MiB together).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
bin=$(cargo test --release -p kvforge-rt --test append_step_gpu --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "append_step_gpu" and m.get("executable"):
        print(m["executable"])')
mkdir -p .bin-append
objcopy --strip-debug "$bin" .bin-append/append_step_gpu
ls -la .bin-append
if [ "${SKIP_WHEEL:-0}" != 1 ]; then
  bash crates/kvforge-py/build-wheel.sh
  ls -la .whl-kvforge
fi
