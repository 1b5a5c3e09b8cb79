#!/usr/bin/env bash
# kvtc (seed 003) on the device, one call: capture Emma's K/V (calibration text) -> `kvforge
# calibrate` -> sizes and reconstruction error per ratio and entropy coder (kvtc_sizes.py) ->
# perplexity, per-layer error and needle of sim:kvtc-<ratio> (eval.py, schemes group `kvtc`).
#
# The lead's calls (one call carries at most 64 MiB with the ~7.6 MB tree: the model halves and
# the stripped binary (~14 MB, `strip -o .bin/kvforge target/release/kvforge` after
# `cargo build --release -p kvforge`) travel in three calls, back to back):
#   call 1, carry [".model-a"]:   mkdir -p /root/m && cp .model-a/part-a /root/m/part-a
#   call 2, carry [".model-b"]:   cat /root/m/part-a .model-b/part-b > /root/m/SmolLM2-135M-Instruct.Q4_1.gguf && rm /root/m/part-a && cp .model-b/SHA256SUMS /root/m/ && (cd /root/m && sha256sum -c SHA256SUMS)
#   call 3, carry [".bin", ".whl-py", "data/austen"], timeout 600:
#     bash benches/quality/kvtc_on_device.sh
# (If the machine went back between calls, /root/m is gone: start again at call 1.)
#
# Grid mode, call 3 instead: `bash benches/quality/kvtc_on_device.sh grid` (same carry, timeout
# 600; about 5-6 minutes): capture 8192 x 6 Emma tokens on the GPU, ONE `kvforge calibrate` for
# the grid key share {0.3,0.35,0.4} x DP rows {64,256} (one PCA per side over 40000 positions, one
# DP per side and row count; files /tmp/kvtc/cal-ks<share>-dp<rows>.safetensors), eval.py at 16x
# for every point (sim:kvtc-16@ks<share>-dp<rows>, fp16 once; perplexity at 2048 on the five
# texts), then the best point at BEST_RATIOS (16,20,32) with per-layer error and the needle at
# 2048 (depths 0.25/0.5/0.75). Writes $OUT/calibrate-grid.log, kvtc-grid-16x.json,
# kvtc-grid-best.json, kvtc-grid-summary.json (kvtc_grid.py: ratios to fp16 per point, the best,
# whether <= 1.01 at 16x with the needle 3/3 holds). Knobs: SHARES, ROWS, SAMPLES, TOKENS,
# WINDOWS, GRID_RATIOS (16,20,32,64: the DP's table grows with the largest budget, 4x would
# quadruple it), BEST_RATIOS, TEXTS; for a dry run on CPU: DEVICE=cpu MODEL_DIR DATA_DIR WORK
# PYTHON KVFORGE_BIN (and small TOKENS, WINDOWS, SAMPLES, TEXTS, CONTEXTS).
# STEP=1 grids step allocations (`calibrate --step`, schemes sim:kvtc-<r>-rans@<tag>), swept at
# SWEEP_RATIO (16) which must be one of GRID_RATIOS.
# Then the frontier (4x..64x) with the best point, the plain mode: e.g. KEY_SHARE=0.35 DP_ROWS=256
# WINDOWS=6 SAMPLES=40000 bash benches/quality/kvtc_on_device.sh
# Coded (the `rans` coder, ratios after entropy coding): CODED=1 RATIOS=16,18,20,22 KEY_SHARE=0.4
# DP_ROWS=64 WINDOWS=6 SAMPLES=40000 bash benches/quality/kvtc_on_device.sh: `calibrate --coded`,
# sizes with rans/deflate/zstd, eval.py of sim:kvtc-<r>-rans per ratio; BASELINE=16,20 adds the
# fixed-width calibration of the same capture at those ratios (sim:kvtc-<r>@fixed, DEFLATE).
# STEP=1 instead of CODED=1: step allocations (`calibrate --step`, entropy-constrained
# quantisation with a model per component; DP_ROWS=512 rows shape the models). With STEP=1:
# DEAD_ZONE (`calibrate --dead-zone`, the encoder's dead zone in steps, e.g. 0.15) and HOLDOUT
# (`--holdout`, share of the sampled positions kept out of the PCA for the variances, e.g. 0.25).
# WEIGHTS (both modes): the feature weights calibrate minimises the error under. capture (default):
# capture_keys.py's (query energy for keys, o_proj over residual energy for values); fisher: the
# diagonal Fisher of the LM loss per pre-RoPE key and value channel (kvtc_fisher.py on the GPU,
# FISHER_WINDOWS x 2048 Emma tokens from the start, default 16); geo: the geometric mean of the two;
# vfisher / kfisher: Fisher on one side, capture's on the other. With fisher the best key share
# on the CPU was 0.4 too (docs/kvtc.md, "Fisher-weighted distortion (CPU)").
# Knobs (env): TOKENS/WINDOWS (capture, 8192 x 4), SAMPLES (PCA positions, 32000), RATIOS,
# DP_ROWS (128), CONTEXTS (2048), NEEDLE (2048), TEXTS (all five). Results under $OUT; eval.py
# writes its JSON after every scheme, so a timeout keeps the ratios finished.
set -eo pipefail
R=$PWD
OUT=${OUT:-/tmp/kvtc-out}
CONTEXTS=${CONTEXTS:-2048}
RATIOS=${RATIOS:-4,8,16,20,32,64}
mkdir -p "$OUT"
M=${MODEL_DIR:-/root/m}
DEV=${DEVICE:-cuda}
PY=${PYTHON:-python3}
DATA_ARG=${DATA_DIR:+--data $DATA_DIR}
if [ ! -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f $M/part-a ] && [ -d .model-b ]; then
  cat $M/part-a .model-b/part-b > $M/SmolLM2-135M-Instruct.Q4_1.gguf && rm $M/part-a && cp .model-b/SHA256SUMS $M/
fi
[ -f $M/SHA256SUMS ] || { echo "no model in $M: run calls 1 and 2 first (see the header)"; exit 2; }
(cd $M && sha256sum -c SHA256SUMS)
export PYTHONPATH=$R/.whl-py PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export KVFORGE_BIN=${KVFORGE_BIN:-$R/.bin/kvforge}
[ -x "$KVFORGE_BIN" ] || { echo "no kvforge binary at $KVFORGE_BIN (carry .bin)"; exit 2; }
# a coded or step calibration: packed with `rans`, its ratios are after entropy coding
RANS=${CODED:-${STEP:-}}
# step allocations: the encoder's dead zone and the positions held out of the PCA
STEP_FLAGS="${DEAD_ZONE:+--dead-zone $DEAD_ZONE} ${HOLDOUT:+--holdout $HOLDOUT}"
W=${WORK:-/tmp/kvtc}
mkdir -p $W
# the weights file calibrate reads (written after the capture: fisher_weights)
case ${WEIGHTS:=capture} in
  capture) WFILE=$W/keys/kv-emma-weights.safetensors ;;
  fisher) WFILE=$W/keys/kv-emma-fisher.safetensors ;;
  geo|vfisher|kfisher) WFILE=$W/keys/kv-emma-fisher-$WEIGHTS.safetensors ;;
  *) echo "WEIGHTS=$WEIGHTS: expected capture, fisher, geo, vfisher or kfisher"; exit 2 ;;
esac
fisher_weights() {  # the Fisher of the LM loss on Emma (calibration text only), and its mixes
  [ "$WEIGHTS" = capture ] && return 0
  $PY benches/quality/kvtc_fisher.py --model $M --device $DEV $DATA_ARG --windows ${FISHER_WINDOWS:-16} \
    --out $W/keys/kv-emma-fisher.safetensors --mix $W/keys/kv-emma-weights.safetensors 2>&1 | grep -v 'it/s]' | tee $OUT/fisher.log
  cp $WFILE $OUT/
}
nvidia-smi -L || true
t0=$(date +%s)
if [ "${1:-}" = grid ]; then
  SHARES=${SHARES:-0.3,0.35,0.4}
  ROWS=${ROWS:-64,256}
  $PY benches/quality/capture_keys.py --model $M --device $DEV $DATA_ARG --tokens ${TOKENS:-8192} --windows ${WINDOWS:-6} --out-dir $W/keys 2>&1 | grep -v 'it/s]' | tail -3
  echo "capture: $(( $(date +%s) - t0 ))s"
  fisher_weights
  $KVFORGE_BIN calibrate --samples $W/keys/kv-emma-per-layer.safetensors --out $W/cal.safetensors \
    --ratios ${GRID_RATIOS:-16,20,32,64} --max-samples ${SAMPLES:-40000} --dp-rows $ROWS ${STEP:+--step} $STEP_FLAGS \
    --weights $WFILE --key-share $SHARES 2>&1 | tee $OUT/calibrate-grid.log
  echo "capture + calibrate: $(( $(date +%s) - t0 ))s" | tee -a $OUT/calibrate-grid.log
  rm -f $W/keys/keys-emma.safetensors $W/keys/values-emma.safetensors
  export KVFORGE_KVTC_CAL=$W/cal.safetensors
  schemes=fp16
  SWEEP=${SWEEP_RATIO:-16}${STEP:+-rans}
  for r in ${ROWS//,/ }; do for k in ${SHARES//,/ }; do schemes+=",sim:kvtc-$SWEEP@ks$k-dp$r"; done; done
  $PY benches/quality/eval.py --model $M --device $DEV $DATA_ARG --schemes $schemes --contexts ${CONTEXTS%%,*} ${TEXTS:+--texts $TEXTS} \
    --layer-error-contexts '' --needle-contexts '' --out $OUT/kvtc-grid-16x.json 2>&1 | grep -v 'it/s]' | tee $OUT/kvtc-grid.log
  echo "sweep: $(( $(date +%s) - t0 ))s"
  best=$($PY benches/quality/kvtc_grid.py best $OUT/kvtc-grid-16x.json)
  echo "best at 16x: $best"
  schemes=
  BEST_RATIOS=${BEST_RATIOS:-16,20,32}
  for r in ${BEST_RATIOS//,/ }; do schemes+="${schemes:+,}sim:kvtc-$r${STEP:+-rans}@$best"; done
  $PY benches/quality/eval.py --model $M --device $DEV $DATA_ARG --schemes $schemes --contexts ${CONTEXTS%%,*} ${TEXTS:+--texts $TEXTS} \
    --layer-error-contexts ${CONTEXTS%%,*} --needle-contexts ${NEEDLE:-2048} --needle-depths 0.25,0.5,0.75 \
    --out $OUT/kvtc-grid-best.json 2>&1 | grep -v 'it/s]' | tee -a $OUT/kvtc-grid.log || echo "BEST RUN FAILED"
  $PY benches/quality/kvtc_grid.py summary $OUT/kvtc-grid-16x.json $OUT/kvtc-grid-best.json $OUT/calibrate-grid.log $OUT/kvtc-grid-summary.json
  echo "total: $(( $(date +%s) - t0 ))s"
  exit 0
fi
python3 benches/quality/capture_keys.py --model $M --device cuda --tokens ${TOKENS:-8192} --windows ${WINDOWS:-4} --out-dir $W/keys 2>&1 | tail -3
fisher_weights
$KVFORGE_BIN calibrate --samples $W/keys/kv-emma-per-layer.safetensors --out $W/cal.safetensors \
  --ratios $RATIOS --max-samples ${SAMPLES:-32000} --dp-rows ${DP_ROWS:-128} ${CODED:+--coded} ${STEP:+--step} $STEP_FLAGS \
  --weights $WFILE --key-share ${KEY_SHARE:-0.3} 2>&1 | tee $OUT/calibrate.log
echo "capture + calibrate: $(( $(date +%s) - t0 ))s" | tee -a $OUT/calibrate.log
export KVFORGE_KVTC_CAL=$W/cal.safetensors
python3 benches/quality/kvtc_sizes.py --model $M --text persuasion --ctx ${CONTEXTS%%,*} --ratios $RATIOS --entropies ${RANS:+rans,}deflate,zstd \
  --out $OUT/kvtc-sizes-${CONTEXTS%%,*}.json 2>&1 | grep kvtc | tee $OUT/sizes.log
if [ -n "$RANS" ]; then
  schemes=fp16
  for r in ${RATIOS//,/ }; do schemes+=",sim:kvtc-$r-rans"; done
  if [ -n "${BASELINE:-}" ]; then  # the fixed-width allocation of the same capture, e.g. BASELINE=16,20
    $KVFORGE_BIN calibrate --samples $W/keys/kv-emma-per-layer.safetensors --out $W/cal-fixed.safetensors \
      --ratios $BASELINE --max-samples ${SAMPLES:-32000} --dp-rows ${DP_ROWS:-128} \
      --weights $W/keys/kv-emma-weights.safetensors --key-share ${KEY_SHARE:-0.3} 2>&1 | tee $OUT/calibrate-fixed.log
    for r in ${BASELINE//,/ }; do schemes+=",sim:kvtc-$r@fixed"; done
  fi
else
  schemes=fp16,kvtc
fi
python3 benches/quality/eval.py --model $M --schemes $schemes --contexts $CONTEXTS ${TEXTS:+--texts $TEXTS} \
  --layer-error-contexts ${CONTEXTS%%,*} --needle-contexts ${NEEDLE:-2048} --needle-depths 0.25,0.5,0.75 \
  --out $OUT/quality-kvtc.json 2>&1 | grep -v 'it/s]' | tee $OUT/kvtc.log
echo "total: $(( $(date +%s) - t0 ))s"
