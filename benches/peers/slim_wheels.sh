#!/usr/bin/env bash
# Download the peer-benchmark wheels (pinned) and slim flashinfer for the GPU machine.
#
#   bash benches/peers/slim_wheels.sh
#
# Writes (both paths are git-ignored, see README.md):
#   .whl/        flashinfer-python (slimmed), apache-tvm-ffi, and the small pure-Python
#                import-time deps of flashinfer + the ninja binary wheel  (~23 MB)
#   .whl-numpy/  numpy (15 MB), only needed where the device image lacks numpy
# Deterministic: pinned versions, and slim_wheel.py writes a byte-identical wheel
# for the same input.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
DL=${DL_DIR:-/tmp/kvforge-peer-wheels}

FLASHINFER=flashinfer-python==0.7.2.post1
TVMFFI=apache-tvm-ffi==0.1.15.post2
# import-time deps of `import flashinfer` that a bare torch image does not have
# (found by importing the slim wheel next to torch 2.11 with nothing else installed)
DEPS=(packaging==26.3 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.18
      tqdm==4.70.1 nvidia-ml-py==13.615.71 ninja==1.13.2)
NUMPY=numpy==2.5.5

mkdir -p .whl .whl-numpy "$DL"
# git rev-parse: in a linked worktree .git is a file and info/exclude lives in the common dir
EXCLUDE=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
for p in /.whl/ /.whl-numpy/; do
  grep -qxF "$p" "$EXCLUDE" 2>/dev/null || { mkdir -p "$(dirname "$EXCLUDE")"; echo "$p" >> "$EXCLUDE"; }
done

pdl() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DL" "$@"
}
pdl "$FLASHINFER" "$TVMFFI" "${DEPS[@]}" "$NUMPY"

rm -f .whl/*.whl .whl-numpy/*.whl
"$PY" benches/peers/slim_wheel.py "$DL"/flashinfer_python-0.7.2.post1-py3-none-any.whl .whl
cp "$DL"/apache_tvm_ffi-0.1.15.post2-*.whl .whl/
for d in "${DEPS[@]}"; do
  n=${d%%==*}; v=${d##*==}; n=${n//-/_}
  cp "$DL"/${n}-${v}-*.whl .whl/
done
cp "$DL"/numpy-2.5.5-cp312-*.whl .whl-numpy/

# sanity: the slimmed wheel installs
T=$(mktemp -d)
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$T" .whl/flashinfer_python-*.whl
test -f "$T/flashinfer/decode.py" -a -f "$T/flashinfer/data/csrc/batch_decode.cu" -a -f "$T/flashinfer/data/include/flashinfer/attention/decode.cuh" \
  -a -f "$T/flashinfer/data/csrc/xqa/mha_sm90.cu" -a -f "$T/flashinfer/data/csrc/flashinfer_xqa_binding.cu"
rm -rf "$T"

ls -l .whl .whl-numpy
du -ch .whl/*.whl | tail -1
sha256sum .whl/*.whl .whl-numpy/*.whl
