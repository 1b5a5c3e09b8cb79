#!/usr/bin/env bash
# Session 17: forced split counts on the new specs (rotated at five CTAs per SM, rdkv at four).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
E=/tmp/s17e; mkdir -p $E && tar xJf .bin-s17t/e.tar.xz -C $E
nvidia-smi -L | tee $OUT/device.txt
t0=$(date +%s)
for i in 1 2; do for n in def 8 10 12 14 16 20; do
  if [ $n = def ]; then unset KVFORGE_SPLITS; else export KVFORGE_SPLITS=$n; fi
  timeout 60 $E/kvforge bench --tiers rotated:r3 --contexts 32768,131072 --batches 11,45,64 --runs 20 > $OUT/sw-$n-$i.log 2>&1
  echo "splits $n $i rc=$? t=$(( $(date +%s) - t0 ))s"
done; done
unset KVFORGE_SPLITS
python3 - <<'PY'
import os
out=os.environ['OUT']; d={}
for n in ['def','8','10','12','14','16','20']:
  for i in [1,2]:
    for l in open(f'{out}/sw-{n}-{i}.log'):
      f=l.split()
      if len(f)>5 and f[0] in ('rotated:r3','rdkv:b4'):
        d.setdefault((f[0],int(f[1]),int(f[2])),{}).setdefault(n,[]).append((f[3],float(f[4])))
for k,x in sorted(d.items()):
  print(k, ' '.join(f"{n}:{x[n][0][0]}:{min(t for s,t in x[n]):.1f}" for n in x))
PY
tar czf $OUT/sw.tgz -C $OUT $(cd $OUT && ls sw-*)
