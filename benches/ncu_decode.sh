#!/usr/bin/env bash
# ncu of one decode launch per (tier, case), on the GPU machine: the metrics behind the "why each
# family misses" table of docs/perf/NOTES.md, written as one JSON file.
#
#   bash benches/ncu_decode.sh OUT.json KVFORGE_BIN "tier,tier,..." "context:batch context:batch ..."
#
# Each case runs `kvforge bench --runs 2` under `ncu --kernel-name regex:_decode_ --launch-skip 2
# --launch-count 1` (two warm launches skipped). ncu locks the clocks, so its durations are longer
# than the bench's; stall metrics are warps stalled per issued instruction.
set -euo pipefail
out=$1; bin=$2; tiers=$3; cases=$4
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
metrics=dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,launch__block_size,launch__grid_size,\
launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__registers_per_thread,\
sm__inst_executed.avg.per_cycle_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
for s in barrier dispatch_stall lg_throttle long_scoreboard math_pipe_throttle mio_throttle no_instruction not_selected selected short_scoreboard wait; do
  metrics+=",smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
tmp=${NCU_RAW:-$(mktemp -d)}; mkdir -p "$tmp"
for t in ${tiers//,/ }; do
  for c in $cases; do
    ctx=${c%%:*}; b=${c##*:}
    f="$tmp/${t//[:+]/_}-$ctx-$b.csv"
    "$NCU" --csv --page raw --kernel-name regex:_decode_ --launch-skip 2 --launch-count 1 --metrics "$metrics" \
      "$bin" bench --tiers "$t" --contexts "$ctx" --batches "$b" --runs 2 > "$f" 2>/dev/null || echo "ncu failed: $t $c" >&2
    echo "$t $ctx $b" > "$f.case"
  done
done
python3 - "$tmp" "$out" <<'PY'
import csv, glob, io, json, subprocess, sys, datetime
tmp, out = sys.argv[1], sys.argv[2]
cases = {}
for f in sorted(glob.glob(f"{tmp}/*.csv")):
    key = open(f + ".case").read().strip()
    lines = [l for l in open(f) if l.startswith('"')]
    if len(lines) < 3:
        continue
    rows = list(csv.reader(io.StringIO("".join(lines))))
    head, vals = rows[0], rows[2]
    rec = {"kernel": vals[head.index("Kernel Name")]}
    for h, v in zip(head, vals):
        if "__" in h:
            try:
                rec[h] = float(v.replace(",", ""))
            except ValueError:
                pass
    cases[key] = rec
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
json.dump({"what": "ncu, one launch of each decode kernel after 2 warm launches (benches/ncu_decode.sh); clocks as ncu locks them; stall metrics are warps stalled per issued instruction",
           "device": gpu, "date": datetime.date.today().isoformat(), "cases": cases}, open(out, "w"), indent=1)
print(f"{len(cases)} cases -> {out}")
PY
