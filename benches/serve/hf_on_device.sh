#!/usr/bin/env bash
# kvforge.hf on SmolLM2-135M (issue 29): first the GPU tests of the decode-step paths
# (crates/kvforge-py/tests/test_gpu.py: Cache.step vs append_step + decode, CUDA-graph replayed
# steps vs Cache.step for fp16 / b4 / r3 across page fills, and kvforge.hf.generate with a CUDA
# graph vs without on SmolLM2 for 64 tokens, fp16 also vs eager), then prefill s and decode
# ms/token (benches/serve/hf_bench.py) of eager and of kvforge fp16 / b4 / r3 three ways:
# model.generate (kvforge:<tier>), kvforge.hf.generate (kvgen:<tier>) and kvforge.hf.generate
# replaying a CUDA graph (kvgraph:<tier>), batch 1 (2K prompt) and batch 4 (2048/1536/1024/517,
# left padded), 64 new tokens, greedy agreement vs eager; then the host µs per layer call
# (benches/serve/hf_host_micro.py) and the prompt write alone per tier (its prefill mode), and
# the Rust append tests / test_hf.py where carried.
# Results and logs under $OUT; expected runtime about 3-4 minutes.
#
# Build here first: `bash crates/kvforge-py/build-wheel.sh` (.whl-kvforge). Optional:
# `bash benches/append/build.sh` (.bin-append) and
# `pip download pytest exceptiongroup tomli -d .bin-hf/pytest --only-binary=:all:` (.bin-hf).
#
# The lead's calls (the model halves travel in two calls, as benches/quality/kvtc_on_device.sh):
#   call 1, carry [".model-a"]:   mkdir -p /root/m && cp .model-a/part-a /root/m/part-a
#   call 2, carry [".model-b"]:   cat /root/m/part-a .model-b/part-b > /root/m/SmolLM2-135M-Instruct.Q4_1.gguf && rm /root/m/part-a && cp .model-b/SHA256SUMS /root/m/ && (cd /root/m && sha256sum -c SHA256SUMS)
#   call 3, carry [".whl-kvforge", ".whl-py", "data/austen"] (+ ".bin-append", ".bin-hf" if built), timeout 300:
#     bash benches/serve/hf_on_device.sh
# (If the machine went back between calls, /root/m is gone: start again at call 1.) Env:
# HF_BACKENDS, HF_NEW (64), HF_REPS (2), HF_LIMIT (the bench's inner timeout, 170 s),
# HF_TESTS=0 skips the GPU tests.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-/tmp/hf-out}
mkdir -p "$OUT"
M=/root/m
if [ ! -f $M/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -f $M/part-a ] && [ -d .model-b ]; then
  cat $M/part-a .model-b/part-b > $M/SmolLM2-135M-Instruct.Q4_1.gguf && rm $M/part-a && cp .model-b/SHA256SUMS $M/
fi
[ -f $M/SHA256SUMS ] || { echo "no model in $M: run calls 1 and 2 first (see the header)"; exit 2; }
shopt -s nullglob
kw=(.whl-kvforge/kvforge-*.whl)
if [ ${#kw[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-kvforge "${kw[@]}" || echo "WARNING: kvforge wheel install failed"
fi
[ -d /tmp/site-kvforge ] || { echo "no kvforge wheel: carry .whl-kvforge (bash crates/kvforge-py/build-wheel.sh)"; exit 2; }
# gguf (transformers' GGUF loader needs it; the image may lack it) travels in .whl-py
export PYTHONPATH="/tmp/site-kvforge:$ROOT/.whl-py:${PYTHONPATH:-}" LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KVFORGE_ROOT=$ROOT KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kvc} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/hf-bench.log"
python3 -c "import kvforge, torch, transformers; print('kvforge', kvforge.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/hf-bench.log"
t0=$(date +%s)
if [ "${HF_TESTS:-1}" != 0 ]; then
  KVFORGE_HF_MODEL_DIR=$M timeout 120 python3 -u -c "
import sys, traceback; sys.path.insert(0, 'crates/kvforge-py/tests'); import test_gpu as t
bad = 0
for n in ['test_step_equals_append_step_then_decode', 'test_graph_launch_needs_graph_prepare', 'test_graph_replayed_steps_equal_plain_steps',
          'test_resident_decode_after_append_steps_matches_replan', 'test_hf_generate_with_a_cuda_graph_matches_without']:
    try:
        getattr(t, n)(); print('PASS', n, flush=True)
    except Exception:
        bad += 1; print('FAIL', n, flush=True); traceback.print_exc()
sys.exit(1 if bad else 0)" > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests: rc $? ($(grep -c '^PASS' "$OUT/gpu-tests.log") passed, $(grep -c '^FAIL' "$OUT/gpu-tests.log") failed; $(( $(date +%s) - t0 )) s)" | tee -a "$OUT/hf-bench.log"
  grep -E '^(PASS|FAIL)|^   ' "$OUT/gpu-tests.log" | tee -a "$OUT/hf-bench.log"
fi
t1=$(date +%s)
B=${HF_BACKENDS:-eager,kvforge:fp16,kvgen:fp16,kvgraph:fp16,kvforge:b4,kvgen:b4,kvgraph:b4,kvforge:r3,kvgen:r3,kvgraph:r3}
timeout "${HF_LIMIT:-170}" python3 -u benches/serve/hf_bench.py --model-dir $M --out "$OUT/hf-bench.json" --new "${HF_NEW:-64}" \
  --reps "${HF_REPS:-2}" --backends "$B" --alone kvgraph:b4 2>&1 | grep -v 'it/s]' | tee -a "$OUT/hf-bench.log"
rc=${PIPESTATUS[0]}
echo "bench: $(( $(date +%s) - t1 )) s (rc $rc)" | tee -a "$OUT/hf-bench.log"
timeout 40 python3 -u benches/serve/hf_host_micro.py --out "$OUT/hf-host-micro.json" > "$OUT/hf-host-micro.log" 2>&1
echo "host micro: rc $?" | tee -a "$OUT/hf-bench.log"; cat "$OUT/hf-host-micro.log" | tee -a "$OUT/hf-bench.log"
# The prompt write alone per tier (30 layers x a 2K prompt through Cache.append_device): host µs
# per layer call and wall ms for all layers, fp16 / b4 / r3.
for t in "specs/baseline.toml fp16" "specs/rdkv.toml b4" "specs/rotated.toml r3"; do
  set -- $t
  timeout 40 python3 -u benches/serve/hf_host_micro.py --spec "$1" --tier "$2" --modes prefill --steps 16 \
    --out "$OUT/hf-prefill-micro-$2.json" 2>&1 | tee -a "$OUT/hf-bench.log"
done
if [ -x .bin-append/append_step_gpu ]; then
  timeout 50 .bin-append/append_step_gpu --ignored --test-threads 1 --nocapture > "$OUT/append-tests.log" 2>&1
  echo "rust append tests: rc $? ($(grep -E '^test result' "$OUT/append-tests.log" | tail -1))" | tee -a "$OUT/hf-bench.log"
else
  echo "no .bin-append/append_step_gpu (optional: bash benches/append/build.sh, carry .bin-append)" | tee -a "$OUT/hf-bench.log"
fi
# kvforge.hf's CPU tests (fake extension; torch and transformers are here, not on the build machine)
if ! python3 -c "import pytest" 2>/dev/null && ls .bin-hf/pytest/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-pytest .bin-hf/pytest/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site-pytest"
fi
if python3 -c "import pytest" 2>/dev/null; then
  timeout 45 python3 -m pytest -q -p no:cacheprovider crates/kvforge-py/tests/test_hf.py > "$OUT/test-hf.log" 2>&1
  tail -3 "$OUT/test-hf.log" | tee -a "$OUT/hf-bench.log"
else
  echo "no pytest (carry .bin-hf): skipped crates/kvforge-py/tests/test_hf.py" | tee -a "$OUT/hf-bench.log"
fi
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/hf-bench.log"
