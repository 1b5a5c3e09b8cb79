#!/usr/bin/env bash
# CPU tests of the Python package, no GPU and no maturin: the cdylib cargo builds is the
# extension module; it is laid next to the Python sources in target/ and imported from there.
#   usage: crates/kvforge-py/ci.sh [python]   (default: $ROOT/.venv/bin/python)
set -euo pipefail
source "$(dirname "$0")/python-env.sh"
cd "$ROOT"
"$PY" -m pip install -q --disable-pip-version-check pytest
cargo build -q --release -p kvforge-py
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PKG="$TARGET/kvforge-py-ci"
rm -rf "$PKG" && mkdir -p "$PKG/kvforge"
cp "$HERE"/python/kvforge/*.py "$HERE"/python/kvforge/py.typed "$PKG/kvforge/"
cp "$TARGET/release/libkvforge_native.so" "$PKG/kvforge/_native.abi3.so"
PYTHONPATH="$PKG" "$PY" -m pytest -q "$HERE/tests/test_cpu.py" "$HERE/tests/test_hf.py"
# The quality harness's torch-free part (the frontier plot's aggregation of result files).
"$PY" -m pytest -q "$ROOT/benches/quality/test_frontier.py"
