#!/usr/bin/env bash
# Builds the abi3 wheel (one wheel for CPython >= 3.9) into .whl-kvforge/ (git-ignored), from
# which it is carried to the GPU machine and installed with
#   pip install --no-deps --target /tmp/py .whl-kvforge/*.whl
#   usage: crates/kvforge-py/build-wheel.sh [python]   (default: $ROOT/.venv/bin/python)
set -euo pipefail
source "$(dirname "$0")/python-env.sh"
# Linked with zig against glibc 2.28 (manylinux_2_28, the floor PyTorch's wheels set), so the
# wheel installs on the GPU machine whatever newer glibc this machine has. The first zig build
# compiles every dependency again (~15 min on 2 cores); later ones are incremental.
# KVFORGE_WHEEL_NATIVE=1 builds for this machine's glibc instead (faster, less portable).
"$PY" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2" ziglang
rm -rf "$ROOT/.whl-kvforge"
if [ "${KVFORGE_WHEEL_NATIVE:-0}" = 1 ]; then
  "$(dirname "$PY")/maturin" build --release -m "$HERE/Cargo.toml" -o "$ROOT/.whl-kvforge"
else
  PATH="$(dirname "$PY"):$PATH" "$(dirname "$PY")/maturin" build --release --zig --compatibility manylinux_2_28 -m "$HERE/Cargo.toml" -o "$ROOT/.whl-kvforge"
fi
ls -l "$ROOT/.whl-kvforge"
