#!/usr/bin/env bash
# End-to-end serving measurements on the GPU machine (results under $OUT, one tarball).
#
#   bash benches/serve/on_device.sh [phase ...]
#
# phases (default: steady tpot):
#   steady   Llama-3-8B-shaped stack (8 layers, random fp16 weights), KV budget 40 GB, contexts
#            32K and 128K, batch = the most sequences the budget admits (cap 256): kvforge fp16 /
#            rdkv b4 / rotated r3 vs FlashInfer fp16 / fp8 vs torch SDPA. tokens/s, ms/step,
#            attention and cache-write time; kvforge b4 / r3 also without the per-step appends
#            (+nowrite: the bound once appends stay on the device; SERVE_NOWRITE=0 leaves them out).
#            Writes $W/steady-l<layers>-<context>.json.
#   tpot     batch 1 x 32K, same backends: time per output token (a 4 GB pool: one sequence).
#   loop     continuous batching, 48 requests of 2K-8K prompts, 64 new tokens each, budget 8 GB.
#   tp2      steady at 32K over 2 GPUs (torchrun, kv heads sharded), budget 40 GB per GPU
#            (an nvidia-h100-x2 machine).
#   quality  SmolLM2-135M real weights (needs /root/m/SmolLM2-135M-Instruct.Q4_1.gguf, see
#            benches/quality/README.md): greedy outputs of each backend vs sdpa fp16.
#   smol-loop SmolLM2-135M, 64 requests x 4K prompts, 64 new tokens, budget 8 GB: the loop's
#            tokens/s per backend on a real model (same model file as quality).
#   fi-warm  only compile FlashInfer's fp16 and fp8 decode modules (JIT cache in
#            /tmp/flashinfer-ws, kept while the machine stays warm).
#   steady32 steady at 32K only, kvforge b4 and r3 then FlashInfer fp16 (SERVE_BACKENDS32), 64
#            steps, under `timeout` (STEADY32_TIMEOUT, 225 s): $OUT/serve-steady32.json (written
#            after each backend) and $OUT/serve-steady32.log, beside the tarball.
#   gpu-tests the resident plan's GPU tests: .bin/resident_gpu and .bin/append_step_gpu (test
#            binaries built here, stripped, see docs/serving.md) with --ignored, then the Python
#            tests test_resident_decode_after_append_steps_matches_replan and the tiled-pool one;
#            logs to $OUT (240 s each under `timeout`).
#   tpot-graph batch 1 x 32K time per output token (SERVE_TPOT_BACKENDS, default FlashInfer fp16,
#            kvforge b4 / r3 / fp16), eager and then with --cuda-graph (the whole model's decode
#            step replayed from one CUDA graph, every backend alike), 64 steps, 4 GB pool, under
#            `timeout` (TPOT_GRAPH_TIMEOUT, 150 s each): $OUT/serve-tpot-eager.json and
#            $OUT/serve-tpot-graph.json (+ .log) beside the tarball. Run fi-warm first on a cold
#            machine.
#   host-micro one layer's Cache.decode host time at batch 64 x 32K, re-planned vs the
#            device-resident plan (benches/serve/host_micro.py, 64 steps each, GPU synchronised
#            at the end only): $OUT/host-micro.json and .log, under `timeout` (150 s).
#
# Carry: .whl (FlashInfer + deps, 22 MiB) and .whl-kvforge (the kvforge wheel with
# Cache(target_only=) and Cache.tile_sequence: bash crates/kvforge-py/build-wheel.sh).
# Env: SERVE_LAYERS (8), SERVE_BUDGET_GB (40), SERVE_STEPS (64), SERVE_BACKENDS, SERVE_CONTEXTS,
# SERVE_MAX_BATCH (256: the cap on the batch the budget admits, read by run.py), SERVE_CUDA_GRAPH=1
# (steady, tpot, steady32 and tp2 with run.py --cuda-graph: each decode step of the whole model
# replayed from a CUDA graph, FlashInfer and kvforge alike; SDPA stays eager).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-/tmp/serve-out}
# results are gathered in $W and come back as one tarball ($OUT/serve.tgz): a call returns ~8 files
W=/tmp/serve-res/serve
mkdir -p "$W" "$OUT"
PHASES=("$@")
[ ${#PHASES[@]} -eq 0 ] && PHASES=(steady tpot)

# FlashInfer and its deps into /tmp/site (benches/peers), then the kvforge wheel beside them
PEERS_INSTALL_ONLY=1 source benches/peers/run_on_device.sh
set +e
shopt -s nullglob
kw=(.whl-kvforge/kvforge-*.whl)
if [ ${#kw[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-kvforge "${kw[@]}" || echo "WARNING: kvforge wheel install failed"
elif [ ! -d /tmp/site-kvforge ]; then
  echo "WARNING: no .whl-kvforge/kvforge-*.whl and none installed: the kvforge backends will fail" >&2
fi
[ -d /tmp/site-kvforge ] && export PYTHONPATH="/tmp/site-kvforge:$PYTHONPATH"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} KVFORGE_ROOT=$ROOT KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kvc}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PYTHONPATH:$ROOT/.whl-py"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import kvforge; print('kvforge', kvforge.__version__)" || true

L=${SERVE_LAYERS:-8}
B=${SERVE_BUDGET_GB:-40}
S=${SERVE_STEPS:-64}  # 64: one kvforge page boundary (a tail encode per sequence and layer) per 64 steps, as in serving
BACKENDS=${SERVE_BACKENDS:-flashinfer,flashinfer_fp8,sdpa,kvforge:fp16,kvforge:b4,kvforge:r3}
CTXS=${SERVE_CONTEXTS:-32768,131072}
R="python3 -u benches/serve/run.py --no-progress"
G=""
[ "${SERVE_CUDA_GRAPH:-0}" = 1 ] && G="--cuda-graph"
t0=$(date +%s)
for ph in "${PHASES[@]}"; do
  echo "== $ph ($(( $(date +%s) - t0 )) s)"
  case $ph in
    steady32) timeout -k 10 "${STEADY32_TIMEOUT:-225}" $R --mode steady --layers "$L" --budget-gb "$B" --contexts 32768 \
            --backends "${SERVE_BACKENDS32:-kvforge:b4,kvforge:r3,flashinfer}" --steps "$S" $G --out "$OUT/serve-steady32.json" 2>&1 | tee "$OUT/serve-steady32.log"
            [ -f "$OUT/serve-steady32.json" ] && cp "$OUT/serve-steady32.json" "$W/" ;;
    host-micro) timeout -k 10 "${HOST_MICRO_TIMEOUT:-150}" python3 -u benches/serve/host_micro.py --batch "${HOST_MICRO_BATCH:-64}" --context 32768 --steps 64 \
            --out "$OUT/host-micro.json" 2>&1 | tee "$OUT/host-micro.log" ;;
    gpu-tests) for t in .bin/resident_gpu .bin/append_step_gpu; do
              [ -x "$t" ] && timeout -k 10 240 "$t" --ignored --test-threads 1 2>&1 | tee "$OUT/$(basename "$t").log"
            done
            timeout -k 10 240 python3 -u -c "import sys; sys.path.insert(0, 'crates/kvforge-py/tests'); import test_gpu as t
for n in ['test_resident_decode_after_append_steps_matches_replan', 'test_target_only_pool_and_tiled_sequences_decode_like_the_template']:
    getattr(t, n)(); print('PASS', n, flush=True)" 2>&1 | tee "$OUT/py-gpu-resident.log" ;;
    tpot-graph) for mode in eager graph; do
              flag=""; [ $mode = graph ] && flag="--cuda-graph"
              timeout -k 10 "${TPOT_GRAPH_TIMEOUT:-150}" $R --mode tpot --layers "$L" --budget-gb 4 --contexts 32768 \
                --backends "${SERVE_TPOT_BACKENDS:-flashinfer,kvforge:b4,kvforge:r3,kvforge:fp16}" --steps "$S" $flag \
                --out "$OUT/serve-tpot-$mode.json" 2>&1 | tee "$OUT/serve-tpot-$mode.log"
              [ -f "$OUT/serve-tpot-$mode.json" ] && cp "$OUT/serve-tpot-$mode.json" "$W/"
            done ;;
    fi-warm) $R --mode tpot --layers 1 --contexts 1024 --backends flashinfer,flashinfer_fp8 --steps 1 --budget-gb 1 --out "$W/fi-warm.json" ;;
    steady) NW=""; [ "${SERVE_NOWRITE:-1}" = 1 ] && NW=",kvforge:b4+nowrite,kvforge:r3+nowrite"
            # one process per context: a fresh allocator for each budget-filling set of runs
            for ctx in ${CTXS//,/ }; do
              $R --mode steady --layers "$L" --budget-gb "$B" --contexts "$ctx" --backends "$BACKENDS$NW" \
                --steps "$S" $G --out "$W/steady-l$L-$ctx.json"
            done ;;
    tpot) $R --mode tpot --layers "$L" --budget-gb 4 --contexts 32768 --backends "$BACKENDS" --steps "$S" $G --out "$W/tpot.json" ;;
    loop) $R --mode loop --layers "$L" --budget-gb 8 --requests 48 --prompt-lens 2048,4096,8192 --max-new 64 --max-batch 64 \
            --backends "$BACKENDS" --out "$W/loop.json" ;;
    tp2) python3 -m torch.distributed.run --standalone --nproc-per-node 2 benches/serve/run.py --no-progress --mode steady --layers "$L" --budget-gb "$B" \
            --contexts 32768 --backends "$BACKENDS" --steps "$S" $G --out "$W/steady-tp2.json" ;;
    quality) $R --mode quality --model smollm2 --model-dir /root/m --prompt-lens 512,1024,2048,4096 --max-new 64 --budget-gb 2 \
            --backends "sdpa,flashinfer,flashinfer_fp8,kvforge:fp16,kvforge:b8,kvforge:b4,kvforge:r4,kvforge:r3" --out "$W/quality.json" ;;
    smol-loop) $R --mode loop --model smollm2 --model-dir /root/m --requests 64 --prompt-lens 4096 --max-new 64 --max-batch 64 \
            --budget-gb 8 --backends "sdpa,flashinfer,flashinfer_fp8,kvforge:fp16,kvforge:b4,kvforge:r3" --out "$W/smol-loop.json" ;;
    *) echo "unknown phase $ph" ;;
  esac 2>&1 | grep -v 'it/s]' | tee "$W/$ph.log"
done
python3 benches/serve/plot.py "$W"/*.json --out "$W/serve.png" 2>&1 | tee "$W/tables.md" || true
tar -C /tmp/serve-res -czf "$OUT/serve.tgz" serve && echo "wrote $OUT/serve.tgz ($(( $(date +%s) - t0 )) s)"
