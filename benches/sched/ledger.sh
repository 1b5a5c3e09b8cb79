#!/usr/bin/env bash
# Session 17: the decode ledger cases with FlashInfer 0.7.2.post1 in the same call: kvforge's
# tiers (split-K by whole waves, rotated at five CTAs per SM), then the peers.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
E=/tmp/s17e; mkdir -p $E && tar xJf .bin-s17t/e.tar.xz -C $E
nvidia-smi -L | tee $OUT/device.txt
t0=$(date +%s)
timeout 150 $E/kvforge bench --tiers rotated:r4,rotated:r3,rotated:k3v2,rotated:r2,rdkv:b8,rdkv:b4,rdkv:b2,baseline:fp16 --contexts 32768,131072 --batches 1,64 --runs 20 --json $OUT/kvforge-s17.json > $OUT/kvforge-s17.log 2>&1
echo "kvforge rc=$? t=$(( $(date +%s) - t0 ))s"; grep -E "^(rdkv|rotated|baseline)" $OUT/kvforge-s17.log
timeout 330 bash benches/peers/run_on_device.sh --systems flashinfer --fi-variants tc,xqa --runs 20 --no-check --contexts 32768,131072 --batches 1,64 --out $OUT/peers-s17.json > $OUT/peers-s17.log 2>&1
echo "peers rc=$? t=$(( $(date +%s) - t0 ))s"; tail -12 $OUT/peers-s17.log
