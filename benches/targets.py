#!/usr/bin/env python3
"""Judge a benchmark run against issue 5's targets: one ledger row per (target, variant, case).

usage: benches/targets.py kvforge.json peers.json [--md ledger.md] [--json ledger.json]

The inputs are the JSON files of `kvforge bench` and `benches/peers/peers.py` from one device
session (same schema). A peer measured in several variants (FlashInfer tensor-core / CUDA-core
decode) counts with its fastest per case, as in `report.py`. The targets (issue 5):

  bw_vs_flashinfer  batch × context ≥ 128K tokens: GB/s ≥ 0.95 × FlashInfer fp16's GB/s.
  beats_fp8         every case: fraction of copy bandwidth > FlashInfer fp8's.
  ratio_speedup     batch × context ≥ 256K: time speed-up over FlashInfer fp16 ≥ 0.9 × the byte
                    ratio (FlashInfer fp16 bytes ÷ the variant's bytes, both as read).
  not_slower_fp8    byte ratio ≥ 2, batch × context ≥ 256K: time ≤ FlashInfer fp8's time.
  latency           batch 1, context ≤ 32K, 4-bit-or-less variants (byte ratio ≥ 3): time ≤ 0.6 ×
                    FlashInfer fp16's time.
  mixed_tier        ladders (`spec:a+b+...`, pages cycling through the tiers): time ≤ 1.05 × the
                    mean of the single-tier times of the same tiers (the same bytes in total).
"""
import argparse
import json
from collections import defaultdict

from report import load

BW_TOKENS = 128 * 1024
BOUND_TOKENS = 256 * 1024


def best_rows(paths):
    """(system label, context, batch) → fastest row (`report.load`), kvforge rows labelled by
    their `spec:tier`, plus the device metadata."""
    rows, meta = load(paths)
    return {(r["label"].removeprefix("kvforge "), r["context"], r["batch"]): dict(r, label=r["label"].removeprefix("kvforge ")) for r in rows}, meta


def ledger(best):
    """Every check as a dict: target, variant, context, batch, value, need, ok."""
    fi = {(c, b): r for (l, c, b), r in best.items() if l == "flashinfer"}
    fp8 = {(c, b): r for (l, c, b), r in best.items() if l == "flashinfer_fp8"}
    ours = {k: r for k, r in best.items() if r["system"] == "kvforge"}
    out = []

    def check(target, r, value, need, ok):
        out.append({"target": target, "variant": r["label"], "context": r["context"], "batch": r["batch"],
                    "value": round(value, 4), "need": round(need, 4), "ok": bool(ok)})

    for (label, c, b), r in sorted(ours.items()):
        f16, f8 = fi.get((c, b)), fp8.get((c, b))
        tokens = b * c
        if f16:
            ratio = f16["bytes_read"] / r["bytes_read"]
            speedup = f16["time_us"] / r["time_us"]
            if tokens >= BW_TOKENS:
                need = 0.95 * f16["gbps"]
                check("bw_vs_flashinfer", r, r["gbps"], need, r["gbps"] >= need)
            if tokens >= BOUND_TOKENS:
                check("ratio_speedup", r, speedup, 0.9 * ratio, speedup >= 0.9 * ratio)
            if b == 1 and c <= 32768 and ratio >= 3:
                need = 0.6 * f16["time_us"]
                check("latency", r, r["time_us"], need, r["time_us"] <= need)
            if f8 and ratio >= 2 and tokens >= BOUND_TOKENS:
                check("not_slower_fp8", r, r["time_us"], f8["time_us"], r["time_us"] <= f8["time_us"])
        if f8:
            check("beats_fp8", r, r["bw_fraction"], f8["bw_fraction"], r["bw_fraction"] > f8["bw_fraction"])
        if "+" in label:
            spec, tiers = label.split(":", 1)
            singles = [ours.get((f"{spec}:{t}", c, b)) for t in tiers.split("+")]
            if all(singles):
                mean = sum(s["time_us"] for s in singles) / len(singles)
                check("mixed_tier", r, r["time_us"], 1.05 * mean, r["time_us"] <= 1.05 * mean)
    return out


def markdown(checks, meta):
    by = defaultdict(list)
    for c in checks:
        by[(c["target"], c["variant"])].append(c)
    lines = [f"Targets of issue 5 on {meta['device']}, {meta['date']} (copy {meta['copy_gbps']:.0f} GB/s). "
             "A row per (target, variant): cases met / checked, and the worst case (value vs need).\n",
             "| target | variant | met | worst case | value | need |", "|---|---|---:|---|---:|---:|"]
    for (target, variant), cs in sorted(by.items()):
        met = sum(c["ok"] for c in cs)
        # Worst = smallest value/need for "at least" targets, largest for "at most" ones.
        at_most = target in ("latency", "not_slower_fp8", "mixed_tier")
        worst = max(cs, key=lambda c: c["value"] / c["need"]) if at_most else min(cs, key=lambda c: c["value"] / max(c["need"], 1e-12))
        mark = "" if met == len(cs) else " ✗"
        lines.append(f"| {target} | {variant} | {met}/{len(cs)}{mark} | {worst['batch']} × {worst['context']} | "
                     f"{worst['value']:.3g} | {worst['need']:.3g} |")
    total = sum(c["ok"] for c in checks)
    lines.append(f"\n{total} of {len(checks)} checks met.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--md")
    ap.add_argument("--json", dest="out_json")
    a = ap.parse_args()
    best, meta = best_rows(a.json)
    checks = ledger(best)
    md = markdown(checks, meta)
    if a.md:
        open(a.md, "w").write(md)
    else:
        print(md)
    if a.out_json:
        json.dump({"device": meta["device"], "date": meta["date"], "checks": checks}, open(a.out_json, "w"), indent=1)
