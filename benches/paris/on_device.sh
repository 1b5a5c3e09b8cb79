#!/usr/bin/env bash
# ParisKV on the GPU machine (no cargo there): binaries built here, carried in .bin/.
#
# Build here (dev machine). A target/ copied from another checkout may embed that checkout's
# device headers (kvforge-gen's build script lists them by absolute path): touch
# crates/kvforge-gen/build.rs first, and check the binaries (last line below):
#   touch crates/kvforge-gen/build.rs
#   cargo build --release -p kvforge-lab --example paris_recall --example paris_bench
#   cargo test --release -p kvforge-rt --test paris_gpu --no-run      # prints the test binary path
#   mkdir -p .bin && cp target/release/examples/paris_{recall,bench} .bin/ \
#     && cp "$(ls -t target/release/deps/paris_gpu-* | grep -v '\.d$' | head -1)" .bin/paris_gpu \
#     && strip .bin/paris_* && grep -c rerank_whole_hmax_kernel .bin/paris_gpu .bin/paris_bench   # both >= 1 (the current paris.cuh)
#
#   bash benches/paris/on_device.sh speed     # carry [".bin"], timeout 400: ONE call (~4 min): the GPU
#                                             # tests, step timing at 128K and 1M x batch 1,
#                                             # compute-sanitizer memcheck of the retrieval, ties and
#                                             # attention tests (every changed kernel), timing at 128K
#                                             # x batch 8 / 32 / 64 (BATCHES), then 1M x 1 per query
#                                             # head and 1M x 1 with the summed rerank (--rank sum) for
#                                             # comparison (COMPARE=0 skips); JSON under $OUT, each
#                                             # step's files written as it ends. The timings run the
#                                             # library's default rank (RANK=max: the group's largest
#                                             # head estimate, rerank_hmax; RANK=sum the summed query's)
#   bash benches/paris/on_device.sh gpu       # carry [".bin"]: GPU tests + step timing (~2 min)
#   bash benches/paris/on_device.sh memcheck  # carry [".bin"]: compute-sanitizer memcheck + racecheck (~3 min)
#   bash benches/paris/on_device.sh whole64   # carry [".bin"], timeout 400: the 64 B summaries'
#                                             # GPU tests + memcheck, then timing with --layout
#                                             # whole64 and subspace4 (128K and 1M x 1, 128K x 64)
#   bash benches/paris/on_device.sh uva       # carry [".bin"] (.bin/uva_read: cargo build --release -p
#                                             # kvforge-lab --example uva_read, strip into .bin/): pinned
#                                             # host read GB/s by run size, region and order (~1 min)
#
# SmolLM2 recall and quality: three calls back to back (the model halves travel in two calls,
# 64 MiB each with the ~8 MB tree; if the machine went back between calls, start at call 1):
#   call 1, carry [".model-a"], timeout 120:
#     bash benches/paris/on_device.sh model-a
#   call 2, carry [".model-b", ".whl-py", "data/austen", ".bin/paris_recall"] (~64 MB with the tree), timeout 600 (~2 min):
#     bash benches/paris/on_device.sh smollm2  # joins the model, captures q/k of 8K Emma tokens
#                                             # (torch, GPU), then Recall@100 of the f64 reference
#                                             # on them tiled to 128K / 1M (host CPU), rope and
#                                             # noise tilings (paris_recall --tile)
#   call 3, carry [".whl-py", "data/austen"], timeout 600 (~3 min):
#     bash benches/paris/on_device.sh quality  # eval.py fp16 + sim:paris-k256 + sim:paris-k256-oracle:
#                                             # perplexity at 8K on five novels, per-layer error at
#                                             # 8K, needle at 8K (depths 0.25/0.5/0.75);
#                                             # SCHEMES=fp16,paris-hmax for the group-max ranking
#   the kernels on the model (after call 1 or 2; the wheel: crates/kvforge-py/build-wheel.sh),
#   carry [".model-b", ".whl-py", ".whl-kvforge", "data/austen"], timeout 600:
#     bash benches/paris/on_device.sh needle   # hf_needle.py: needle at 4K / 8K and greedy agreement
#                                             # with eager, one retrieval per kv head ranked by
#                                             # RANK (max, default; sum), or per query head (RANK=qhead);
#                                             # LAYOUT=subspace4 for the seed's 112 B summaries (default whole64)
# Only .bin/paris_recall is needed for call 2:
#   cargo build --release -p kvforge-lab --example paris_recall && mkdir -p .bin && strip -o .bin/paris_recall target/release/examples/paris_recall
# Knobs (env): LAYERS (capture, 3,8,15,22,28), HEADS (3), QUERIES (32), LENGTHS (131072,1048576),
# GROUP (kv: one retrieval per kv head for the summed group query; kvmax: per kv head, ranked by
# the largest head estimate, the runtime's default Rank::GroupMax; head: per query head),
# TEXTS (eval texts, all five), SCHEMES (fp16,paris).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-/tmp/paris-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KVFORGE_CUDA_INCLUDE=${KVFORGE_CUDA_INCLUDE:-/usr/local/cuda/include}
export KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kvforge-cache}
QK=/tmp/paris-qk-emma.safetensors
DATE=$(date -u +%F)
RANK=${RANK:-max}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z' || echo gpu)

M=/root/m
join_model() {
  if [ ! -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f $M/part-a ] && [ -d .model-b ]; then
    cat $M/part-a .model-b/part-b > $M/SmolLM2-135M-Instruct.Q4_1.gguf && rm $M/part-a && cp .model-b/SHA256SUMS $M/
  fi
  [ -f $M/SHA256SUMS ] || { echo "no model in $M: run 'model-a' (carry .model-a), then this call with .model-b" >&2; exit 2; }
  (cd $M && sha256sum -c SHA256SUMS)
}

case "${1:-}" in
  model-a)
    mkdir -p $M && cp .model-a/part-a $M/part-a && ls -l $M
    ;;
  smollm2)
    join_model
    t0=$(date +%s)
    PYTHONPATH=$ROOT/.whl-py PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 benches/paris/capture_qk.py --model $M --device cuda \
      --tokens 8192 --layers "${LAYERS:-3,8,15,22,28}" --out "$QK" 2>&1 | grep -v 'it/s]' | tee "$OUT/paris-capture.log"
    ls -l "$QK"
    echo "capture: $(( $(date +%s) - t0 ))s"
    for tile in rope noise; do
      .bin/paris_recall --qk "$QK" --tile $tile --group "${GROUP:-kv}" --lengths "${LENGTHS:-131072,1048576}" --heads "${HEADS:-3}" --queries "${QUERIES:-32}" \
        --label "SmolLM2-135M Emma 8K tokens tiled ($tile), $GPU host CPU ($(nproc) cores), $DATE" \
        --out "$OUT/paris-recall-smollm2-$tile${GROUP:+-$GROUP}-$DATE.json" 2>&1 | tee "$OUT/paris-recall-$tile.log"
      python3 -c "import json,sys; [print('$tile', r) for r in json.load(open(sys.argv[1]))['summary']]" "$OUT/paris-recall-smollm2-$tile${GROUP:+-$GROUP}-$DATE.json"
    done
    echo "total: $(( $(date +%s) - t0 ))s"
    ;;
  quality)
    join_model
    t0=$(date +%s)
    F="$OUT/quality-paris-$GPU-$DATE.json"
    PYTHONPATH=$ROOT/.whl-py PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 benches/quality/eval.py --model $M --schemes "${SCHEMES:-fp16,paris}" \
      --contexts 8192 ${TEXTS:+--texts $TEXTS} --layer-error-contexts 8192 --needle-contexts 8192 --needle-depths 0.25,0.5,0.75 \
      --out "$F" 2>&1 | grep -v 'it/s]' | tee "$OUT/quality-paris.log"
    python3 - "$F" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["schemes"]
base = r.get("fp16", {}).get("perplexity", {}).get("8192", {}).get("mean")
for name, s in r.items():
    p = s.get("perplexity", {}).get("8192", {}).get("mean")
    n = s.get("needle", {}).get("score")
    ratio = p / base if p and base else None
    print(f"{name}: ppl@8192 {p} ratio {ratio} needle {n} recall_by_layer {s.get('stats', {}).get('recall_vs_exact_topk_by_layer')}")
PY
    echo "total: $(( $(date +%s) - t0 ))s"
    ;;
  needle)
    join_model
    # The wheel from this call's carry, or one a previous call on this machine installed (if the
    # carry would pass 64 MiB: install it alone first, carry [".whl-kvforge"],
    # `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-kvforge/*.whl`).
    if ls .whl-kvforge/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl-kvforge/*.whl
    fi
    [ -d /tmp/site/kvforge ] || { echo "no kvforge wheel: carry .whl-kvforge (crates/kvforge-py/build-wheel.sh)" >&2; exit 2; }
    case "$RANK" in
      qhead) MODE=() ;;
      *) MODE=(--per-kv-head --rank "$RANK") ;;
    esac
    PYTHONPATH=/tmp/site:$ROOT/.whl-py PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVFORGE_ROOT=$ROOT python3 benches/paris/hf_needle.py --model $M "${MODE[@]}" \
      --layout "${LAYOUT:-whole64}" --out "$OUT/paris-hf-needle-$RANK-${LAYOUT:-whole64}-$GPU-$DATE.json" 2>&1 | grep -v 'it/s]' | tee "$OUT/paris-hf-needle-$RANK-${LAYOUT:-whole64}.log"
    ;;
  gpu)
    nvidia-smi -L
    .bin/paris_gpu --include-ignored --test-threads 1 2>&1 | tee "$OUT/paris-gpu-tests-$GPU-$DATE.log"
    .bin/paris_bench --lengths 131072,1048576 --batch 1 --kv-heads 8 --gqa 4 --head-dim 128 --iters 20 --rank "$RANK" \
      --out "$OUT/paris-bench-$GPU-$DATE.json" 2>&1 | tee "$OUT/paris-bench.log"
    ;;
  speed)
    nvidia-smi -L
    t0=$(date +%s)
    # A failing test or sanitizer report must not skip the timings: reported, then on.
    .bin/paris_gpu --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/paris-gpu-tests-$GPU-$DATE.log" || echo "GPU TESTS FAILED"
    echo "tests: $(( $(date +%s) - t0 ))s"
    .bin/paris_bench --lengths 131072,1048576 --batch 1 --kv-heads 8 --gqa 4 --head-dim 128 --iters 20 --rank "$RANK" \
      --out "$OUT/paris-bench-$GPU-$DATE.json" 2>&1 | tee "$OUT/paris-bench.log"
    echo "bench batch 1: $(( $(date +%s) - t0 ))s"
    compute-sanitizer --tool memcheck .bin/paris_gpu --ignored --test-threads 1 retrieval_matches ties_keep attention_matches 2>&1 | tail -20 | tee "$OUT/paris-memcheck-$GPU-$DATE.log" || echo "MEMCHECK FAILED"
    echo "memcheck: $(( $(date +%s) - t0 ))s"
    .bin/paris_bench --lengths 131072 --batch "${BATCHES:-8,32,64}" --kv-heads 8 --gqa 4 --head-dim 128 --iters 10 --host-gib 48 --rank "$RANK" \
      --out "$OUT/paris-bench-batch-$GPU-$DATE.json" 2>&1 | tee -a "$OUT/paris-bench.log"
    echo "bench batches: $(( $(date +%s) - t0 ))s"
    if [ "${COMPARE:-1}" = 1 ]; then
      .bin/paris_bench --lengths 1048576 --batch 1 --kv-heads 8 --gqa 4 --head-dim 128 --iters 10 --per-query-head \
        --out "$OUT/paris-bench-per-query-head-$GPU-$DATE.json" 2>&1 | tee -a "$OUT/paris-bench.log"
      .bin/paris_bench --lengths 1048576 --batch 1 --kv-heads 8 --gqa 4 --head-dim 128 --iters 20 --rank sum \
        --out "$OUT/paris-bench-rank-sum-$GPU-$DATE.json" 2>&1 | tee -a "$OUT/paris-bench.log"
    fi
    echo "total: $(( $(date +%s) - t0 ))s"
    ;;
  whole64)
    # The 64 B summaries (SummaryLayout::Whole64, docs/paris.md "GPU bytes per key", "To run on a
    # device"): their GPU tests (summaries against the reference's encoder, retrieval against
    # retrieve_group_compact, ties), memcheck of them, then the step timing with --layout whole64
    # (its default schedule, rho 0.30 from 64K) beside the 112 B layout's. ~4 min.
    nvidia-smi -L
    t0=$(date +%s)
    .bin/paris_gpu --ignored --test-threads 1 --nocapture whole64 ties_keep paris_module 2>&1 | tee "$OUT/paris-gpu-tests-whole64-$GPU-$DATE.log" || echo "GPU TESTS FAILED"
    compute-sanitizer --tool memcheck .bin/paris_gpu --ignored --test-threads 1 whole64 2>&1 | tail -20 | tee "$OUT/paris-memcheck-whole64-$GPU-$DATE.log" || echo "MEMCHECK FAILED"
    echo "tests + memcheck: $(( $(date +%s) - t0 ))s"
    for L in whole64 subspace4; do
      .bin/paris_bench --lengths 131072,1048576 --batch 1 --kv-heads 8 --gqa 4 --head-dim 128 --iters 20 --rank "$RANK" --layout $L \
        --out "$OUT/paris-bench-$L-$GPU-$DATE.json" 2>&1 | tee -a "$OUT/paris-bench-whole64.log"
      .bin/paris_bench --lengths 131072 --batch "${BATCHES:-64}" --kv-heads 8 --gqa 4 --head-dim 128 --iters 10 --host-gib 48 --rank "$RANK" --layout $L \
        --out "$OUT/paris-bench-batch-$L-$GPU-$DATE.json" 2>&1 | tee -a "$OUT/paris-bench-whole64.log"
    done
    echo "total: $(( $(date +%s) - t0 ))s"
    ;;
  uva)
    # Pinned-host read throughput over UVA by pattern (kvforge-lab example uva_read): random runs
    # of 256 B (a K row), 512 B (a token's K and V, the interleaved slab) and 4 KiB over 0.25 /
    # 8 / 32 GiB, index-sorted and sequential beside them. Tells whether the fetch is bound by
    # 4 KiB page translations or by the bus (docs/paris.md, "The UVA fetch"). ~1 min.
    nvidia-smi -L
    .bin/uva_read --region-gib "${REGIONS:-0.25,8,32}" --run-bytes 256,512,4096 --total-mib 26 \
      --out "$OUT/uva-read-$GPU-$DATE.json" 2>&1 | tee "$OUT/uva-read.log"
    .bin/uva_read --region-gib 32 --run-bytes 512 --total-mib 26 --unroll 2 2>&1 | tee -a "$OUT/uva-read.log"
    ;;
  memcheck)
    compute-sanitizer --tool memcheck .bin/paris_gpu --ignored --test-threads 1 retrieval_matches ties_keep attention_matches 2>&1 | tail -20 | tee "$OUT/paris-memcheck-$GPU-$DATE.log"
    compute-sanitizer --tool racecheck .bin/paris_gpu --ignored --test-threads 1 retrieval_matches 2>&1 | tail -20 | tee "$OUT/paris-racecheck-$GPU-$DATE.log"
    ;;
  *)
    echo "usage: $0 speed|gpu|memcheck|whole64|uva|model-a|smollm2|quality|needle" >&2
    exit 2
    ;;
esac
