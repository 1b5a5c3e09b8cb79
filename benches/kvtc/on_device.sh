#!/usr/bin/env bash
# GPU machine: the kvtc GPU restore (issue 28) checked and timed. Build and carry first
# (benches/kvtc/build.sh on the CPU machine; carry [".bin-kvtc"]):
#   1. the Rust GPU tests (tests/kvtc_gpu.rs): the restore kernels against their f64 mirror on
#      random shapes (one-token, odd and short-last chunks; head dims 16/64/128; partial RoPE;
#      a basis over all layers, per layer and per two layers), the pipelined restore equal to
#      the plain one bit for bit, and against the CPU unpack of a really calibrated and packed
#      cache (both basis scopes);
#   2. compute-sanitizer memcheck of those tests on the small shapes (KVTC_TEST_SMALL=1);
#   3. restore throughput for a Llama-8B-shaped 128K cache (32 layers x 8 kv heads x d 128,
#      synthetic calibrations and chunks of the right shape at 16x and 64x, basis over all
#      layers and per layer): GB/s of fp16 output of the kernels alone (CUDA events, after a
#      warm-up), the host entropy-decode rate (DEFLATE, zstd) on 16 threads, and the whole load
#      end to end (container saved in memory -> read -> pipelined decode / pinned upload /
#      kernels, wall clock);
#   4. the prefill it competes with: benches/prefill_sdpa.py at 131072 tokens (one Llama-8B
#      layer: SDPA causal Hq 32 / Hkv 8 / d 128 + QKV/O projections + MLP, random weights),
#      times 32 layers; then $OUT/kvtc-restore-vs-prefill.json puts them side by side.
# Writes under $OUT: kvtc-tests.log, kvtc-memcheck.log, kvtc-restore.json (+ .log),
# prefill-128k.json, kvtc-restore-vs-prefill.json. Expected runtime: about 3 minutes; PARTS
# (default "tests bench": 1, 3 and 4) picks steps, e.g. PARTS=memcheck (2) in a second call;
# SCOPES (default "all,1") the basis scopes of step 3.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-/tmp/kvtc-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/usr/local/cuda/lib64} KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kvforge-kvtc}
B=.bin-kvtc
status=0
nvidia-smi -L | tee "$OUT/device.txt"
if [ ! -x $B/kvtc_gpu ] || [ ! -x $B/kvtc_restore_bench ]; then
  echo "no $B/kvtc_gpu or $B/kvtc_restore_bench (run benches/kvtc/build.sh and carry .bin-kvtc)"; exit 2
fi
PARTS=${PARTS:-tests bench}
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has tests; then
echo "== 1. GPU tests"
timeout 120 $B/kvtc_gpu --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/kvtc-tests.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has memcheck; then
echo "== 2. compute-sanitizer memcheck (small shapes)"
KVTC_TEST_SMALL=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 3 $B/kvtc_gpu --ignored --test-threads 1 2>&1 | tee "$OUT/kvtc-memcheck.log" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has bench; then
echo "== 3. restore throughput, 128K tokens x 32 layers x 8 kv heads x d 128"
timeout 200 $B/kvtc_restore_bench --tokens 131072 --layers 32 --kv-heads 8 --head-dim 128 --ratios 16,64 --scopes ${SCOPES:-all,1} --threads 16 --reps 3 \
  --json "$OUT/kvtc-restore.json" > /dev/null 2> >(tee "$OUT/kvtc-restore.log" >&2)
[ $? = 0 ] || status=1
echo "== 4. prefill of one layer at 131072 tokens (torch SDPA + projections)"
timeout 60 python3 benches/prefill_sdpa.py 131072 2>&1 | tee "$OUT/prefill-128k.json"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
python3 - "$OUT" <<'PY' || status=1
import json, sys
out = sys.argv[1]
r = json.load(open(f"{out}/kvtc-restore.json"))
pre = json.loads(open(f"{out}/prefill-128k.json").read().strip().splitlines()[-1])
prefill_s = pre["layer_us"] * 32 / 1e6
rows = []
for x in r["rows"]:
    host = x["host_entropy_decode"]
    load = x.get("pipelined_load", {})
    rows.append({
        "scope": x.get("scope", "all"),
        "restore_gflop_per_token": x.get("restore_gflop_per_token"),
        "ratio": x["ratio"],
        "gpu_restore_s": x["gpu_kernels_ms_median"] / 1e3,
        "gpu_restore_gb_per_s": x["restore_gb_per_s"],
        "matmul_tflops": x["matmul_tflops"],
        "host_deflate_decode_s": host["deflate"]["seconds"],
        "host_zstd_decode_s": host["zstd"]["seconds"],
        "upload_s": x["gpu_upload_ms_median"] / 1e3,
        "prefill_s": prefill_s,
        "prefill_over_gpu_restore": prefill_s / (x["gpu_kernels_ms_median"] / 1e3),
        "load_end_to_end_s": {e: v["load_wall_s"] for e, v in load.items()},
        "load_stage_sum_s": {e: v["stage_sum_s"] for e, v in load.items()},
        "load_pipeline": {e: v["pipeline"] for e, v in load.items()},
        "prefill_over_load_zstd": prefill_s / load["zstd"]["load_wall_s"] if "zstd" in load else None,
    })
summary = {"what": "restore of a 128K-token Llama-8B-shaped cache (synthetic calibration) vs its prefill (32 x one layer of benches/prefill_sdpa.py at 131072 tokens)",
           "device": r["device"], "prefill_layer": pre, "rows": rows}
json.dump(summary, open(f"{out}/kvtc-restore-vs-prefill.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
fi
exit $status
