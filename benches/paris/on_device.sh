#!/usr/bin/env bash
# ParisKV on the GPU machine (no cargo there): binaries built here, carried in .bin/.
#
# Build here (dev machine):
#   cargo build --release -p kvforge-lab --example paris_recall --example paris_bench
#   cargo test --release -p kvforge-rt --test paris_gpu --no-run      # prints the test binary path
#   mkdir -p .bin && cp target/release/examples/paris_{recall,bench} .bin/ \
#     && cp "$(ls -t target/release/deps/paris_gpu-* | grep -v '\.d$' | head -1)" .bin/paris_gpu \
#     && strip .bin/paris_*
#
#   bash benches/paris/on_device.sh gpu       # carry [".bin"]: GPU tests + step timing (~2 min)
#   bash benches/paris/on_device.sh memcheck  # carry [".bin"]: compute-sanitizer memcheck + racecheck (~3 min)
#   bash benches/paris/on_device.sh capture   # carry [".model-b", ".whl-py", "data/austen"], after the
#                                             # call that copied .model-a (benches/quality/README.md)
#   bash benches/paris/on_device.sh recall    # carry [".bin"]: recall on the captured keys (~2 min)
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
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z' || echo gpu)

case "${1:-}" in
  gpu)
    nvidia-smi -L
    .bin/paris_gpu --include-ignored --test-threads 1 2>&1 | tee "$OUT/paris-gpu-tests-$GPU-$DATE.log"
    .bin/paris_bench --lengths 131072,1048576 --batch 1 --kv-heads 8 --gqa 4 --head-dim 128 --iters 20 \
      --out "$OUT/paris-bench-$GPU-$DATE.json" 2>&1 | tee "$OUT/paris-bench.log"
    ;;
  memcheck)
    compute-sanitizer --tool memcheck .bin/paris_gpu --ignored --test-threads 1 attention_matches 2>&1 | tail -20 | tee "$OUT/paris-memcheck-$GPU-$DATE.log"
    compute-sanitizer --tool racecheck .bin/paris_gpu --ignored --test-threads 1 retrieval_matches 2>&1 | tail -20 | tee "$OUT/paris-racecheck-$GPU-$DATE.log"
    ;;
  capture)
    R=$PWD
    test -f /root/m/SmolLM2-135M-Instruct.Q4_1.gguf || { cat /root/m/part-a .model-b/part-b > /root/m/SmolLM2-135M-Instruct.Q4_1.gguf && rm /root/m/part-a && cp .model-b/SHA256SUMS /root/m/; }
    (cd /root/m && sha256sum -c SHA256SUMS)
    PYTHONPATH=$R/.whl-py PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 python3 benches/paris/capture_qk.py --model /root/m --device cuda \
      --tokens 8192 --layers 3,8,15,22,28 --out "$QK" 2>&1 | grep -v 'it/s]' | tee "$OUT/paris-capture.log"
    ls -l "$QK"
    ;;
  recall)
    test -f "$QK" || { echo "no $QK: run 'capture' first on this (warm) machine" >&2; exit 1; }
    .bin/paris_recall --qk "$QK" --lengths 131072,1048576 --heads 2 --queries 32 \
      --label "SmolLM2-135M emma 8K tokens tiled, $GPU host CPU, $DATE" --out "$OUT/paris-recall-smollm2-$DATE.json" 2>&1 | tee "$OUT/paris-recall.log"
    ;;
  *)
    echo "usage: $0 gpu|memcheck|capture|recall" >&2
    exit 2
    ;;
esac
