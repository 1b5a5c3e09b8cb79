# Sourced by build-wheel.sh and ci.sh: sets HERE, ROOT and PY (the python given as $1, else
# $ROOT/.venv/bin/python, created when a fresh clone has none; `.ci/run` makes it too).
HERE="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY=${1:-$ROOT/.venv/bin/python}
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
