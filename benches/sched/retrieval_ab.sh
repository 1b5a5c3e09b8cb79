#!/usr/bin/env bash
# Session 17, call 1: GPU checks of d5566bb / 009ab3c (main) and the one-download branch, then
# RetrievalCache wall time main vs branch, alternating.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
B=/tmp/s17; mkdir -p $B && tar xJf .bin-s17t/s17.tar.xz -C $B
nvidia-smi -L | tee $OUT/device.txt
t0=$(date +%s)
for v in main onedl; do
  for t in paris_gpu retrieval_gpu; do
    timeout 200 $B/$v/$t --ignored --test-threads 1 > $OUT/$v-$t.log 2>&1; echo "$v $t rc=$? $(grep -E '^test result' $OUT/$v-$t.log)  t=$(( $(date +%s) - t0 ))s"
  done
done
compute-sanitizer --tool memcheck $B/main/paris_gpu --ignored --test-threads 1 retrieval_matches ties_keep attention_matches 2>&1 | tail -6 > $OUT/main-paris-memcheck.log; tail -3 $OUT/main-paris-memcheck.log; echo "memcheck t=$(( $(date +%s) - t0 ))s"
for i in 1 2; do for v in main onedl; do
  timeout 120 $B/$v/retrieval_bench --spec rotated.toml --tier r3 --lengths 131072,1048576 --out $OUT/rb-$v-$i.json > $OUT/rb-$v-$i.log 2>&1; echo "rb $v $i rc=$? t=$(( $(date +%s) - t0 ))s"; grep -iE "wall|device|µs" $OUT/rb-$v-$i.log | tail -4
done; done
