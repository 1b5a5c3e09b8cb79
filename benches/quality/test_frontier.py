"""frontier.py's aggregation (no torch, no GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontier  # noqa: E402


def _row(scheme, ctx, text, ppl, frac=1.0):
    return {"scheme": scheme, "context": ctx, "text": text, "ppl": ppl, "bytes_fraction": frac}


def test_relative_is_the_mean_ratio_per_text():
    rows = [_row("fp16", 2048, "a", 10.0), _row("fp16", 2048, "b", 20.0),
            _row("rdkv@0.2", 2048, "a", 11.0, 0.2), _row("rdkv@0.2", 2048, "b", 20.0, 0.3),
            _row("rdkv@0.2", 4096, "a", 99.0, 0.3)]  # no fp16 at 4096: left out
    rel = frontier.relative(rows)
    assert set(rel) == {"rdkv@0.2"} and set(rel["rdkv@0.2"]) == {2048}
    b, r = rel["rdkv@0.2"][2048]
    assert abs(b - 0.25) < 1e-12 and abs(r - 1.05) < 1e-12


def test_series_merge_files_with_one_label_and_filter_sims():
    budget = {"meta": {"device": "NVIDIA H200"}, "rows": [_row("fp16", 2048, "a", 10.0), _row("rotated@0.2", 2048, "a", 10.2, 0.3)]}
    low = {"meta": {"device": "NVIDIA H200"}, "rows": [_row("fp16", 2048, "a", 10.0), _row("rotated@0.1", 2048, "a", 10.6, 0.2)]}
    sim = {"meta": {"device": "NVIDIA H200"}, "schemes": {
        "fp16": {"perplexity": {"2048": {"a": 10.0, "mean": 10.0}}, "bytes_fraction_of_fp16": 1.0},
        "sim:fp8": {"perplexity": {"2048": {"a": 10.1, "mean": 10.1}}, "bytes_fraction_of_fp16": 0.5},
        "sim:int2": {"perplexity": {"2048": {"a": 20.0, "mean": 20.0}}, "bytes_fraction_of_fp16": 0.17}}}
    kern = {"device": "NVIDIA H200", "tiers": {
        "specs/baseline.toml:fp16": {"tier": "fp16", "contexts": {}},
        "specs/rotated.toml:r3": {"tier": "r3", "contexts": {"2048": {"texts": {"a": {"ratio": 1.006, "bytes_per_token_per_kv_head": 80.0}}}}}}}
    lines = frontier.series([("x.json", "w", budget), ("y.json", "w", low)], [("s.json", {"sim:fp8"}, sim)], [("k.json", kern)])
    labels = [s["label"] for s in lines]
    assert labels == ["RDKV rotated ladder, w (H200)", "FlashInfer fp8 e4m3, simulated (H200)", "r3 through the kernels, fp16 sink + recent pages (H200)"]
    assert [p[0] for p in lines[0]["points"][2048]] == [0.2, 0.3] and lines[0]["file"] == "x.json, y.json"
    assert lines[1]["points"][2048] == [(0.5, 1.01)]
    b, r = lines[2]["points"][2048][0]
    assert abs(b - 80.0 / 256.0) < 1e-12 and abs(r - 1.006) < 1e-12
    md = frontier.table(lines)
    assert "`x.json`, `y.json`" in md and md.count("\n") == 2 + 4
