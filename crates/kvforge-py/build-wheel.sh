#!/usr/bin/env bash
# Builds the abi3 wheel (one wheel for CPython >= 3.9) into .whl-kvforge/ (git-ignored), from
# which it is carried to the GPU machine and installed with
#   pip install --no-deps --target /tmp/py .whl-kvforge/*.whl
#   usage: crates/kvforge-py/build-wheel.sh [python]   (default: $ROOT/.venv/bin/python)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY=${1:-$ROOT/.venv/bin/python}
"$PY" -m pip install -q --disable-pip-version-check "maturin>=1.9,<2"
rm -rf "$ROOT/.whl-kvforge"
"$(dirname "$PY")/maturin" build --release -m "$HERE/Cargo.toml" -o "$ROOT/.whl-kvforge"
ls -l "$ROOT/.whl-kvforge"
