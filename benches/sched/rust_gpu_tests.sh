#!/usr/bin/env bash
# Session 17: the remaining Rust GPU test binaries after the split rule and the rotated c5 specs.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
T=/tmp/s17t; mkdir -p $T && tar xJf .bin-s17t/t.tar.xz -C $T
nvidia-smi -L | tee $OUT/device.txt
t0=$(date +%s)
for t in schedules_gpu certified_gpu append_step_gpu external_gpu window_gpu mass_window_gpu controller_gpu; do
  timeout 90 $T/$t --ignored --test-threads 1 > $OUT/$t.log 2>&1; echo "$t rc=$? $(grep '^test result' $OUT/$t.log | tail -1) t=$(( $(date +%s) - t0 ))s"
  grep -E "FAILED|panicked" $OUT/$t.log | head -3
done
