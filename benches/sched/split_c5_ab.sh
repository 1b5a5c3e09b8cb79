#!/usr/bin/env bash
# Session 17: base (1b4386d binary, c4 specs) / split (new split rule, c4 specs) / c5 (new rule,
# rotated at five CTAs per SM, ladders at four), alternating twice; then serving at 32K.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_CUDA_INCLUDE=/usr/local/cuda/include KVFORGE_CACHE_DIR=/tmp/kc
D=/tmp/s17d; mkdir -p $D && tar xJf .bin-s17t/d.tar.xz -C $D
nvidia-smi -L | tee $OUT/device.txt
t0=$(date +%s)
for i in 1 2; do for c in base split c5; do
  bin=$D/kvforge-new; root=$D/root4
  [ $c = base ] && bin=$D/kvforge-old
  [ $c = c5 ] && root=.
  timeout 100 $bin bench --root $root --tiers rotated:r4,rotated:r3,rotated:k3v2,rotated:r2 --ladders rotated:r4+r3+k3v2+r2 --contexts 32768,131072 --batches 1,45,64 --runs 20 --json $OUT/ab-$c-$i.json > $OUT/ab-$c-$i.log 2>&1
  echo "$c $i rc=$? t=$(( $(date +%s) - t0 ))s"
done; done
python3 - <<'PY'
import os
out=os.environ['OUT']; d={}
for c in ['base','split','c5']:
  for i in [1,2]:
    for l in open(f'{out}/ab-{c}-{i}.log'):
      f=l.split()
      if len(f)>5 and f[0].startswith('rotated'):
        d.setdefault((f[0],int(f[1]),int(f[2])),{}).setdefault(c,[]).append((f[3],float(f[4])))
for k,x in sorted(d.items()):
  b=min(t for s,t in x['base']); print(k, ' '.join(f"{c}:{x[c][0][0]}:{min(t for s,t in x[c]):.1f}({min(t for s,t in x[c])/b:.3f})" for c in ['base','split','c5'] if c in x))
PY
tar czf $OUT/ab-logs.tgz -C $OUT $(cd $OUT && ls ab-*)
rm -f $OUT/ab-*.log $OUT/ab-*.json
SERVE_CUDA_GRAPH=1 SERVE_LAYERS=32 SERVE_NOWRITE=0 SERVE_STEPS=32 SERVE_CONTEXTS=32768 SERVE_BACKENDS=flashinfer,flashinfer_fp8,kvforge:r3 SERVE_MAX_BATCH=512 timeout 420 bash benches/serve/on_device.sh steady > $OUT/serve32.log 2>&1
echo "serve rc=$? t=$(( $(date +%s) - t0 ))s"; grep -E "steady|tok/s" $OUT/serve32.log | tail -8
