#!/usr/bin/env bash
# Issue 25 / 26 A/B of the low-bit per-warp decode (docs/perf/NOTES.md v13, v14: the KVF2 integer layout), on the GPU machine.
#
#   bash benches/lowbit/on_device.sh [phase ...]        (default: selftest bench ncu)
#
# Binaries (built on the dev machine, stripped, carried in .bin-lowbit/):
#   .bin-lowbit/kvforge-new  this branch's `cargo build --release -p kvforge`
#   .bin-lowbit/kvforge-old  the same built from main's HEAD (the baseline of the A/B)
# The kernels are JIT-compiled from the headers each binary embeds (separate NVRTC caches).
#
# phases:
#   selftest  kvforge-new precompile --strict (sm_90, every core: fills the NVRTC cache, $OUT/precompile-new.json
#             has registers and spills), then kvforge-new selftest on $LOWBIT_SELFTEST_SPECS
#             (default specs/rdkv.toml specs/trizone.toml specs/certified.toml: every spec with
#             integer codes, whose 4-bit layout changed in KVF2; every decode variant against
#             the f64 reference): $OUT/selftest-new.json, .log. The rotated layout 3 (KVF3, NOTES
#             v15) is checked with LOWBIT_SELFTEST_SPECS=specs/rotated.toml.
#   bench     kvforge bench of rdkv b8/b4/b2 and rotated r4/r3/r2 at 128K x 64, 128K x 1, 32K x 8,
#             32K x 1, old and new binaries alternating (old, new, new, old):
#             $OUT/bench-{old,new}-{1,2}-{128k,32k}.json, then a summary table $OUT/ab.md
#   ncu       one launch each of b4 and r3 at 8 x 128K under ncu, old and new: executed warp
#             instructions, issue-slot and DRAM use ($OUT/ncu-{old,new}.json)
# Env: LOWBIT_OLD_ROOT (the old binary's --root, see kv below), LOWBIT_RUNS (bench --runs, 20), LOWBIT_SELFTEST_FILTER (selftest --filter, e.g. d128),
# LOWBIT_SELFTEST_SPECS (the selftest's and precompile's spec files), LOWBIT_PRECOMPILE_TIMEOUT (120 s),
# LOWBIT_SELFTEST_TIMEOUT (170 s). Where the three specs do not fit one call, run the selftest phase
# twice on the same warm machine: LOWBIT_SELFTEST_SPECS=specs/rdkv.toml, then
# LOWBIT_SELFTEST_SPECS="specs/trizone.toml specs/certified.toml" (each call keeps its own $OUT).
# One phase per call keeps each well under 4 minutes: `on_device.sh selftest`, `on_device.sh bench`,
# `on_device.sh ncu` (selftest alone: precompile <= 100 s, selftest <= 130 s; the precompile fills
# /tmp/kvc-lowbit-new, which a later call on the same warm machine reuses).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-/tmp/lowbit-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
PHASES=("$@")
[ ${#PHASES[@]} -eq 0 ] && PHASES=(selftest bench ncu)
RUNS=${LOWBIT_RUNS:-20}
SPECS=${LOWBIT_SELFTEST_SPECS:-specs/rdkv.toml specs/trizone.toml specs/certified.toml}
TIERS=rdkv:b8,rdkv:b4,rdkv:b2,rotated:r4,rotated:r3,rotated:r2
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
for b in old new; do
  [ -x .bin-lowbit/kvforge-$b ] || { echo "missing .bin-lowbit/kvforge-$b" >&2; exit 2; }
done
# One NVRTC cache per binary: their headers differ, so their keys do anyway; separate dirs keep
# the first compile's time out of the other binary's runs.
# LOWBIT_OLD_ROOT: a tree holding the baseline's specs/ and kernels-generated/ (an A/B of a spec
# or schedule change: the binaries read both from --root), passed to the old binary's runs.
kv() { local b=$1 cmd=$2; shift 2; local root=(); [ "$b" = old ] && [ -n "${LOWBIT_OLD_ROOT:-}" ] && root=(--root "$LOWBIT_OLD_ROOT"); KVFORGE_CACHE_DIR=/tmp/kvc-lowbit-$b .bin-lowbit/kvforge-$b "$cmd" "${root[@]}" "$@"; }

for ph in "${PHASES[@]}"; do
  case $ph in
    selftest)
      # selftest compiles variant after variant; precompile fills the NVRTC cache on every core
      # first (and reports registers and spills of every kernel).
      timeout ${LOWBIT_PRECOMPILE_TIMEOUT:-120} bash -c "KVFORGE_CACHE_DIR=/tmp/kvc-lowbit-new .bin-lowbit/kvforge-new precompile --arch sm_90 --strict --report $OUT/precompile-new.json $SPECS" \
        > "$OUT/precompile-new.log" 2>&1
      echo "precompile rc=$? ($(( $(date +%s) - T0 )) s)"; tail -3 "$OUT/precompile-new.log"
      timeout ${LOWBIT_SELFTEST_TIMEOUT:-170} bash -c "KVFORGE_CACHE_DIR=/tmp/kvc-lowbit-new .bin-lowbit/kvforge-new selftest ${LOWBIT_SELFTEST_FILTER:+--filter $LOWBIT_SELFTEST_FILTER} $SPECS --json $OUT/selftest-new.json" \
        > "$OUT/selftest-new.log" 2>&1
      echo "selftest rc=$? ($(( $(date +%s) - T0 )) s)"; tail -3 "$OUT/selftest-new.log"; grep -E 'FAIL' "$OUT/selftest-new.log" | head -20
      ;;
    bench)
      # Warm both JIT caches first (the compile is not what is timed, but it takes the budget).
      for b in old new; do
        timeout 90 bash -c "$(declare -f kv); kv $b bench --tiers $TIERS --contexts 4096 --batches 1 --runs 1" > "$OUT/warm-$b.log" 2>&1
      done
      for rep in 1 2; do
        order="old new"; [ $rep = 2 ] && order="new old"
        for b in $order; do
          timeout 60 bash -c "$(declare -f kv); kv $b bench --tiers $TIERS --contexts 131072 --batches 64,1 --runs $RUNS --json $OUT/bench-$b-$rep-128k.json" > "$OUT/bench-$b-$rep-128k.log" 2>&1 || echo "bench $b $rep 128k rc=$?"
          timeout 40 bash -c "$(declare -f kv); kv $b bench --tiers $TIERS --contexts 32768 --batches 8,1 --runs $RUNS --json $OUT/bench-$b-$rep-32k.json" > "$OUT/bench-$b-$rep-32k.log" 2>&1 || echo "bench $b $rep 32k rc=$?"
          echo "bench $b rep $rep done ($(( $(date +%s) - T0 )) s)"
        done
      done
      python3 - "$OUT" <<'PY' | tee "$OUT/ab.md"
import glob, json, os, sys, statistics
out = sys.argv[1]
t = {}
for f in sorted(glob.glob(f"{out}/bench-*-*-*.json")):
    b = os.path.basename(f).split("-")[1]
    for r in json.load(open(f))["results"]:
        t.setdefault((r["tier"], r["context"], r["batch"]), {}).setdefault(b, []).append((r["time_us"], r.get("bw_fraction", 0.0)))
print("| tier | context x batch | old us (of copy) | new us (of copy) | new/old |")
print("|---|---|---:|---:|---:|")
for (tier, ctx, bt), v in sorted(t.items()):
    o, n = v.get("old"), v.get("new")
    if o and n:
        mo, mn = statistics.median(x[0] for x in o), statistics.median(x[0] for x in n)
        fo, fn = statistics.median(x[1] for x in o), statistics.median(x[1] for x in n)
        print(f"| {tier} | {ctx // 1024}K x {bt} | {mo:.1f} ({fo:.2f}) | {mn:.1f} ({fn:.2f}) | {mn / mo:.3f} |")
PY
      ;;
    ncu)
      NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
      for b in old new; do
        KVFORGE_CACHE_DIR=/tmp/kvc-lowbit-$b timeout 75 bash benches/ncu_decode.sh "$OUT/ncu-$b.json" .bin-lowbit/kvforge-$b "rdkv:b4,rotated:r3" "131072:8" \
          > "$OUT/ncu-$b.log" 2>&1 || echo "ncu $b rc=$?"
      done
      python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for b in ("old", "new"):
    try:
        c = json.load(open(f"{out}/ncu-{b}.json"))["cases"]
    except Exception as e:
        print(b, "no ncu result:", e); continue
    for k, r in sorted(c.items()):
        print(f"{b} {k}: {r.get('smsp__inst_executed.sum', 0) / 1e6:.1f} M warp inst, issue {r.get('smsp__issue_active.avg.pct_of_peak_sustained_active', 0):.0f}%, "
              f"DRAM {r.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', 0):.0f}%, {r.get('gpu__time_duration.sum', 0) / 1e3:.1f} us, regs {r.get('launch__registers_per_thread', 0):.0f}")
PY
      ;;
    *) echo "unknown phase $ph" >&2 ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
