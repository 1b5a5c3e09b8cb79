#!/usr/bin/env python3
"""Summary of a kvtc calibration grid (``kvtc_on_device.sh grid``), standard library only.

``best``: from the sweep's eval.py JSON (16x, or the SWEEP_RATIO of a step grid) (fp16 plus ``sim:kvtc-<r>@<tag>`` per grid point),
prints the tag with the lowest mean perplexity ratio to fp16 (ties: the first).
``summary``: joins the sweep, the best point's run (ratios, needle) and the calibrate log into
one JSON: per point and ratio the perplexity ratio per text and its mean, bytes per token, the
needle score; the best tag; whether the target (ratio <= 1.01 with the needle 3/3 at the sweep's ratio: 16x for the
fixed-width DP, after entropy coding for `-rans` sweeps) holds.

    python3 kvtc_grid.py best sweep.json
    python3 kvtc_grid.py summary sweep.json best.json calibrate.log out.json
"""

from __future__ import annotations

import json
import re
import sys

SCHEME = re.compile(r"^sim:kvtc-(?P<ratio>[0-9.]+)(?:-(?P<entropy>deflate|zstd|rans|none))?@(?P<tag>[A-Za-z0-9._-]+)$")


def rows(result: dict, ref: dict | None = None) -> list[dict]:
    """One row per kvtc scheme: tag, ratio, perplexity ratio to fp16 (per text and mean over the
    texts both have), bytes per token per kv head, needle score."""
    schemes = result["schemes"]
    ref = ref or schemes.get("fp16")
    if not ref or "perplexity" not in ref:
        raise SystemExit("no fp16 perplexity to compare with")
    out = []
    for name, s in schemes.items():
        m = SCHEME.match(name)
        if not m or "perplexity" not in s:
            continue
        for ctx, row in s["perplexity"].items():
            base = ref["perplexity"].get(ctx, {})
            per_text = {t: v / base[t] for t, v in row.items() if t != "mean" and t in base}
            out.append({
                "scheme": name, "tag": m["tag"], "ratio": float(m["ratio"]), "context": int(ctx),
                "ppl_ratio_mean": sum(per_text.values()) / len(per_text) if per_text else None,
                "ppl_ratio_per_text": per_text, "ppl_mean": row.get("mean"), "fp16_ppl_mean": base.get("mean"),
                "bytes_per_token_per_kv_head": s.get("bytes_per_token_per_kv_head"),
                "needle": (s.get("needle") or {}).get("score"),
                "entropy": m["entropy"] or "deflate",
                # measured after entropy coding, mean over the texts' packs (eval.py's pack_stats)
                "ratio_after_entropy": (sum(p["ratio_after_entropy"] for p in s["pack_stats"]) / len(s["pack_stats"])) if s.get("pack_stats") else None,
            })
    return out


def best_tag(result: dict) -> str:
    r = [x for x in rows(result) if x["ppl_ratio_mean"] is not None]
    if not r:
        raise SystemExit("no kvtc grid scheme with a perplexity")
    return min(r, key=lambda x: x["ppl_ratio_mean"])["tag"]


def calibrate_lines(log: str) -> dict:
    """Per grid file: the calibration line and its per-ratio allocation lines."""
    out, cur = {}, None
    for line in log.splitlines():
        m = re.match(r"calibration (\S+) \(key share ([0-9.]+), (\d+) DP rows.*-> (\S+)", line)
        if m:
            cur = f"ks{m[2]}-dp{m[3]}"
            out[cur] = {"id": m[1], "file": m[4], "allocations": []}
        elif cur and re.match(r"\s+[0-9.]+x (keys|values)", line):
            out[cur]["allocations"].append(line.strip())
    return out


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "best":
        print(best_tag(json.load(open(argv[1]))))
        return
    if len(argv) == 5 and argv[0] == "summary":
        sweep = json.load(open(argv[1]))
        try:
            best = json.load(open(argv[2]))
        except (OSError, ValueError):
            best = {"schemes": {}}
        log = open(argv[3]).read() if argv[3] != "-" else ""
        ref = sweep["schemes"].get("fp16")
        sweep_rows = rows(sweep)
        best_rows = rows(best, ref) if best.get("schemes") else []
        tag = best_tag(sweep)
        # the target at the sweep's ratio (16x for the fixed-width DP; a coded or step sweep's
        # ratio is after entropy coding)
        sweep_ratio = sweep_rows[0]["ratio"] if sweep_rows else 16.0
        at = [r for r in best_rows + sweep_rows if r["tag"] == tag and r["ratio"] == sweep_ratio]
        target = None
        if at:
            r = next((r for r in at if r["needle"] is not None), at[0])
            target = {"ratio": sweep_ratio, "entropy": r["entropy"], "ratio_after_entropy": r["ratio_after_entropy"], "ppl_ratio": r["ppl_ratio_mean"], "needle": r["needle"],
                      "met_1.01_needle": bool(r["ppl_ratio_mean"] is not None and r["ppl_ratio_mean"] <= 1.01 and r["needle"] == 1.0)}
        summary = {
            "what": "kvtc calibration grid on SmolLM2-135M: perplexity ratio to fp16 (mean over the evaluation texts) per grid point at the sweep ratio, then the best point's ratios with the needle",
            "device": sweep.get("meta", {}).get("device"), "argv_sweep": sweep.get("meta", {}).get("argv"),
            "fp16_perplexity": ref.get("perplexity") if ref else None,
            "sweep": sorted(sweep_rows, key=lambda r: (r["ppl_ratio_mean"] is None, r["ppl_ratio_mean"] or 0)),
            "best_tag": tag, "best": sorted(best_rows, key=lambda r: r["ratio"]), "target": target,
            "calibrations": calibrate_lines(log),
        }
        json.dump(summary, open(argv[4], "w"), indent=1)
        for r in summary["sweep"]:
            print(f"  {r['scheme']:<32} ppl ratio {r['ppl_ratio_mean']:.4f}  {r['bytes_per_token_per_kv_head']:.2f} B/token/kv head")
        print(f"best {tag}:")
        for r in summary["best"]:
            print(f"  {r['ratio']:>5}x ppl ratio {r['ppl_ratio_mean']:.4f} needle {r['needle']}")
        print(f"target (<= 1.01 with the needle 3/3 at the sweep ratio): {target}")
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
