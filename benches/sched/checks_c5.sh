#!/usr/bin/env bash
# Session 17: checks of the new split rule and the rotated spec at five CTAs per SM.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
E=/tmp/s17e; mkdir -p $E && tar xJf .bin-s17t/e.tar.xz -C $E
t0=$(date +%s)
timeout 150 $E/kvforge selftest specs/rotated.toml --json $OUT/selftest-rotated.json > $OUT/selftest-rotated.log 2>&1; echo "selftest rc=$? t=$(( $(date +%s) - t0 ))s"; tail -3 $OUT/selftest-rotated.log
timeout 120 $E/gpu --ignored --test-threads 1 > $OUT/gpu-tests.log 2>&1; echo "gpu rc=$? $(grep '^test result' $OUT/gpu-tests.log) t=$(( $(date +%s) - t0 ))s"
KVFORGE_SPLITS=3 timeout 120 $E/gpu --ignored --test-threads 1 > $OUT/gpu-tests-splits3.log 2>&1; echo "gpu splits3 rc=$? $(grep '^test result' $OUT/gpu-tests-splits3.log) t=$(( $(date +%s) - t0 ))s"
timeout 120 $E/resident_gpu --ignored --test-threads 1 > $OUT/resident-tests.log 2>&1; echo "resident rc=$? $(grep '^test result' $OUT/resident-tests.log) t=$(( $(date +%s) - t0 ))s"
timeout 150 compute-sanitizer --tool memcheck $E/kvforge selftest --filter d128_g4 specs/rotated.toml > $OUT/memcheck-rotated.log 2>&1; echo "memcheck rc=$? t=$(( $(date +%s) - t0 ))s"; grep -E "ERROR SUMMARY|passed|PASS|FAIL" $OUT/memcheck-rotated.log | tail -4
