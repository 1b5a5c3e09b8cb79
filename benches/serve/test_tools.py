"""CPU tests of the result tools (pure Python): plot.py's series (one panel per GPU count,
CUDA-graph rows apart, errors and non-steady rows left out, the last file's point kept) and
micro.py's run-and-save loop of the host micro-benchmarks.

    python -m pytest -q benches/serve/
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import micro  # noqa: E402
import plot  # noqa: E402


def _row(backend, ctx, tps, batch, mode="steady", **kw):
    return {"mode": mode, "backend": backend, "context": ctx, "tokens_per_s": tps, "batch": batch, **kw}


def test_series_split_by_gpu_count_and_graph():
    one = {"tp": 1, "results": [_row("flashinfer", 131072, 700, 9), _row("flashinfer", 32768, 1800, 37),
                                _row("kvforge:r3", 32768, 5500, 183), _row("kvforge:r3", 32768, 6000, 183, cuda_graph=True),
                                _row("kvforge:b4", 32768, 0, 0, error="OOM"), _row("kvforge:b4", 32768, 9, 1, mode="tpot")]}
    two = {"tp": 2, "results": [_row("flashinfer", 32768, 3700, 74), _row("kvforge:r3", 32768, 10300, 256)]}
    again = {"tp": 1, "results": [_row("flashinfer", 32768, 1900, 37)]}
    s = plot.series([("steady", one), ("steady-tp2", two), ("steady32", again)])
    assert sorted(s) == [1, 2]
    assert s[1]["flashinfer"] == [(32768, 1900, 37), (131072, 700, 9)]  # ascending contexts, the later file's 32K
    assert s[1]["kvforge:r3"] == [(32768, 5500, 183)] and s[1]["kvforge:r3 +graph"] == [(32768, 6000, 183)]
    assert "kvforge:b4" not in s[1]  # errors and tpot rows are not steady points
    assert s[2] == {"flashinfer": [(32768, 3700, 74)], "kvforge:r3": [(32768, 10300, 256)]}


def test_graph_cell():
    assert plot.graph_cell({}) == "no"
    assert plot.graph_cell({"cuda_graph": True, "graph_captures": 2, "graph_eager_steps": 1}) == "yes (2 captures, 1 eager steps)"
    assert plot.graph_cell({"cuda_graph": False, "cuda_graph_error": "RuntimeError: x"}).startswith("no (RuntimeError")


def test_micro_run_modes_keeps_going_and_writes_after_each_mode(tmp_path):
    import json
    import types

    out = tmp_path / "m.json"
    a = types.SimpleNamespace(out=str(out), steps=3)
    seen = []

    def run(mode):
        seen.append(json.loads(out.read_text())["results"] if out.exists() else None)
        if mode == "bad":
            raise RuntimeError("boom")
        return {"mode": mode, **micro.summary([3e-6, 1e-6, 2e-6], 1e6, "host_us")}

    doc = micro.run_modes(a, ["one", "bad", "two"], run, {"device": "cpu"})
    assert [r["mode"] for r in doc["results"]] == ["one", "bad", "two"] and doc["results"][1]["error"] == "RuntimeError: boom"
    assert doc["results"][0] == {"mode": "one", "host_us_mean": 2.0, "host_us_median": 2.0, "host_us_max": 3.0}
    assert seen[0] is None and len(seen[1]) == 1 and len(seen[2]) == 2  # written after every mode
    assert json.loads(out.read_text()) == doc and doc["args"] == {"out": str(out), "steps": 3} and doc["device"] == "cpu"
    assert micro.summary([], 1.0, "x") == {}
