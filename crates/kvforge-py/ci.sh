#!/usr/bin/env bash
# CPU tests of the Python package, no GPU and no maturin: the cdylib cargo builds is the
# extension module; it is laid next to the Python sources in target/ and imported from there.
#   usage: crates/kvforge-py/ci.sh [python]   (default: $ROOT/.venv/bin/python)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY=${1:-$ROOT/.venv/bin/python}
# A fresh clone has no .venv (`.ci/run` makes one): create it, or say what to install.
if [ ! -x "$PY" ]; then
  if [ -n "${1:-}" ]; then
    echo "error: $PY is not an executable python" >&2
    exit 2
  fi
  echo "creating $ROOT/.venv (python3 -m venv)" >&2
  python3 -m venv "$ROOT/.venv" || {
    echo "error: python3 -m venv failed: install python3 and python3-venv (Debian/Ubuntu: apt install python3-venv), or pass a python: $0 /path/to/python" >&2
    exit 2
  }
fi
cd "$ROOT"
"$PY" -m pip install -q --disable-pip-version-check pytest
cargo build -q --release -p kvforge-py
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PKG="$TARGET/kvforge-py-ci"
rm -rf "$PKG" && mkdir -p "$PKG/kvforge"
cp "$HERE"/python/kvforge/*.py "$HERE"/python/kvforge/py.typed "$PKG/kvforge/"
cp "$TARGET/release/libkvforge_native.so" "$PKG/kvforge/_native.abi3.so"
PYTHONPATH="$PKG" "$PY" -m pytest -q "$HERE/tests/test_cpu.py" "$HERE/tests/test_hf.py"
