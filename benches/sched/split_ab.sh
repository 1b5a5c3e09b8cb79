#!/usr/bin/env bash
# Session 17: split-K rule A/B (old: one wave or no split; new: whole waves within 5%), alternating.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
mkdir -p .bin-s17b && tar xJf .bin-s17t/kv.tar.xz -C .bin-s17b
nvidia-smi -L | tee $OUT/device.txt
t0=$(date +%s)
for i in 1 2; do for v in old new; do
  timeout 200 .bin-s17b/kvforge-$v bench --tiers rotated:r3,rdkv:b4 --contexts 32768,131072 --batches 1,11,30,45,64 --runs 20 --json $OUT/split-$v-$i.json > $OUT/split-$v-$i.log 2>&1
  echo "$v $i rc=$? t=$(( $(date +%s) - t0 ))s"
done; done
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT && ls split-*)
