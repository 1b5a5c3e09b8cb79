#!/usr/bin/env bash
# CPU machine: builds what benches/kvtc/on_device.sh carries to the GPU machine.
#   .bin-kvtc/kvtc_gpu             the Rust GPU tests of the kvtc restore (debug info stripped)
#   .bin-kvtc/kvtc_restore_bench   the restore throughput bench (examples/kvtc_restore_bench.rs)
# Carry: .bin-kvtc (two binaries, debug info stripped: check `du -sh .bin-kvtc` stays well under
# the 64 MiB a call carries with the tree).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
artifacts=$(cargo build --release -p kvforge-rt --test kvtc_gpu --example kvtc_restore_bench --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] in ("kvtc_gpu", "kvtc_restore_bench") and m.get("executable"):
        print(m["target"]["name"], m["executable"])')
mkdir -p .bin-kvtc
while read -r name path; do
  objcopy --strip-debug "$path" ".bin-kvtc/$name"
done <<< "$artifacts"
ls -la .bin-kvtc
