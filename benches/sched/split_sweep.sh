#!/usr/bin/env bash
# Session 17: forced split counts (KVFORGE_SPLITS) on the new specs (rotated at five CTAs per SM,
# rdkv at four), each count twice, best of two per case. Env: SWEEP_COUNTS, SWEEP_TIERS,
# SWEEP_BATCHES. The first sweep used the defaults; the second
#   SWEEP_COUNTS="def 8 10 12 14 16 20" SWEEP_TIERS=rotated:r3 SWEEP_BATCHES=11,45,64
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
COUNTS=${SWEEP_COUNTS:-def 3 5 8 10 16 24}
TIERS=${SWEEP_TIERS:-rotated:r3,rdkv:b4}
BATCHES=${SWEEP_BATCHES:-45,64}
E=/tmp/s17e; mkdir -p $E && tar xJf .bin-s17t/e.tar.xz -C $E
nvidia-smi -L | tee $OUT/device.txt
t0=$(date +%s)
for i in 1 2; do for n in $COUNTS; do
  if [ $n = def ]; then unset KVFORGE_SPLITS; else export KVFORGE_SPLITS=$n; fi
  timeout 60 $E/kvforge bench --tiers $TIERS --contexts 32768,131072 --batches $BATCHES --runs 20 > $OUT/sw-$n-$i.log 2>&1
  echo "splits $n $i rc=$? t=$(( $(date +%s) - t0 ))s"
done; done
unset KVFORGE_SPLITS
COUNTS="$COUNTS" TIERS="$TIERS" python3 - <<'PY'
import os
out, counts, tiers = os.environ['OUT'], os.environ['COUNTS'].split(), os.environ['TIERS'].split(',')
d = {}
for n in counts:
  for i in [1, 2]:
    for l in open(f'{out}/sw-{n}-{i}.log'):
      f = l.split()
      if len(f) > 5 and f[0] in tiers:
        d.setdefault((f[0], int(f[1]), int(f[2])), {}).setdefault(n, []).append((f[3], float(f[4])))
for k, x in sorted(d.items()):
  print(k, ' '.join(f"{n}:{x[n][0][0]}:{min(t for s, t in x[n]):.1f}" for n in x))
PY
tar czf $OUT/sw.tgz -C $OUT $(cd $OUT && ls sw-*)
