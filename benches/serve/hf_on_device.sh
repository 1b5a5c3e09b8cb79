#!/usr/bin/env bash
# kvforge.hf on SmolLM2-135M (issue 29): prefill s and decode ms/token of generate() with eager,
# sdpa and kvforge fp16 / b8 / b4 / r3, batch 1 (2K prompt) and batch 4 (2048/1536/1024/517,
# left padded), 64 new tokens, greedy agreement vs eager and batch rows vs alone
# (benches/serve/hf_bench.py); then the checks: the Rust GPU tests of the device appends
# (.bin-append/append_step_gpu: append_step and the prompt-sized append_device vs host appends,
# every tier family), Cache.append_device vs Cache.append from Python, and kvforge.hf's tests
# (crates/kvforge-py/tests/test_hf.py: torch + transformers, a fake extension; pytest from
# .bin-hf/pytest). Results and logs under $OUT; expected runtime about 3-4 minutes.
#
# Build here first: `bash benches/append/build.sh` (.bin-append and .whl-kvforge), and
# `pip download pytest exceptiongroup tomli -d .bin-hf/pytest --only-binary=:all:` (~2 MB).
#
# The lead's calls (the model halves travel in two calls, as benches/quality/kvtc_on_device.sh):
#   call 1, carry [".model-a"]:   mkdir -p /root/m && cp .model-a/part-a /root/m/part-a
#   call 2, carry [".model-b"]:   cat /root/m/part-a .model-b/part-b > /root/m/SmolLM2-135M-Instruct.Q4_1.gguf && rm /root/m/part-a && cp .model-b/SHA256SUMS /root/m/ && (cd /root/m && sha256sum -c SHA256SUMS)
#   call 3, carry [".whl-kvforge", ".bin-append", ".bin-hf", "data/austen"], timeout 330:
#     bash benches/serve/hf_on_device.sh
# (.whl-kvforge: bash crates/kvforge-py/build-wheel.sh. If the machine went back between calls,
# /root/m is gone: start again at call 1.) Env: HF_BACKENDS, HF_NEW (64), HF_REPS (2), HF_LIMIT
# (the bench's inner timeout, 160 s).
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
export PYTHONPATH="/tmp/site-kvforge:${PYTHONPATH:-}" LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export KVFORGE_ROOT=$ROOT KVFORGE_CACHE_DIR=${KVFORGE_CACHE_DIR:-/tmp/kvc} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/hf-bench.log"
python3 -c "import kvforge, torch, transformers; print('kvforge', kvforge.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/hf-bench.log"
t0=$(date +%s)
timeout "${HF_LIMIT:-160}" python3 -u benches/serve/hf_bench.py --model-dir $M --out "$OUT/hf-bench.json" --new "${HF_NEW:-64}" \
  --reps "${HF_REPS:-2}" ${HF_BACKENDS:+--backends $HF_BACKENDS} 2>&1 | grep -v 'it/s]' | tee -a "$OUT/hf-bench.log"
rc=${PIPESTATUS[0]}
echo "bench: $(( $(date +%s) - t0 )) s (rc $rc)" | tee -a "$OUT/hf-bench.log"
if [ -x .bin-append/append_step_gpu ]; then
  timeout 50 .bin-append/append_step_gpu --ignored --test-threads 1 --nocapture > "$OUT/append-tests.log" 2>&1
  echo "rust append tests: rc $? ($(grep -E '^test result' "$OUT/append-tests.log" | tail -1))" | tee -a "$OUT/hf-bench.log"
else
  echo "no .bin-append/append_step_gpu (bash benches/append/build.sh, carry .bin-append)" | tee -a "$OUT/hf-bench.log"
fi
timeout 25 python3 -c "import sys; sys.path.insert(0, 'crates/kvforge-py/tests'); import test_gpu as t; t.test_append_device_equals_append(); print('PASS test_append_device_equals_append')" \
  > "$OUT/append-device-py.log" 2>&1; tail -3 "$OUT/append-device-py.log" | tee -a "$OUT/hf-bench.log"
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
