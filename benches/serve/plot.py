#!/usr/bin/env python3
"""Tables and a plot of serving results (``run.py`` JSONs): tokens/s vs context per backend.

    python3 benches/serve/plot.py results/*.json --out serve.png

Prints one markdown table per file (steady / tpot / loop / quality rows); draws tokens/s
against context on log axes for every (file, backend) of the steady rows when matplotlib is
importable.
"""

import argparse
import json
import sys
from pathlib import Path


def table(doc, name):
    rows = doc.get("results", [])
    print(f"\n### {name}: {doc.get('device')}, tp {doc.get('tp')}, {doc.get('config', {}).get('layers')} layers, "
          f"budget {doc.get('args', {}).get('budget_gb')} GB\n")
    steady = [r for r in rows if r.get("mode") in ("steady", "tpot")]
    if steady:
        print("| mode | backend | context | batch | tokens/s | ms/step | attention ms/step | kv write ms/step | bytes/token |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in steady:
            if "error" in r:
                print(f"| {r['mode']} | {r['backend']} | {r['context']} | | error: {r['error'][:80]} | | | | |")
                continue
            print(f"| {r['mode']} | {r['backend']} | {r['context']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
                  f"{r.get('attn_ms_per_step') or 0:.2f} | {r.get('kv_write_ms_per_step') or 0:.2f} | {r['bytes_per_token']:.0f} |")
    loop = [r for r in rows if r.get("mode") == "loop"]
    if loop:
        print("| backend | tokens/s | requests | peak blocks | ttft p50 s | tpot p50 ms | tpot p90 ms |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in loop:
            if "error" in r:
                print(f"| {r['backend']} | error: {r['error'][:80]} | | | | | |")
                continue
            print(f"| {r['backend']} | {r['tokens_per_s']:.0f} | {r['requests']} | {r['peak_blocks']}/{r['kv_blocks']} | "
                  f"{r['ttft_p50_s']:.3f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p90_ms']:.1f} |")
    qual = [r for r in rows if r.get("mode") == "quality"]
    if qual:
        print("| backend | against | prompt lengths | equal fraction | first mismatch |")
        print("|---|---|---|---|---|")
        for r in qual:
            if "error" in r:
                print(f"| {r['backend']} | error: {r['error'][:80]} | | | |")
                continue
            print(f"| {r['backend']} | {r['against']} | {r['prompt_lens']} | {[round(x, 2) for x in r['equal_fraction']]} | {r['first_mismatch']} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="serve.png")
    a = ap.parse_args()
    docs = []
    for f in a.files:
        try:
            docs.append((Path(f).stem, json.loads(Path(f).read_text())))
        except (OSError, ValueError) as e:
            print(f"skip {f}: {e}", file=sys.stderr)
    for name, d in docs:
        table(d, name)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for name, d in docs:
        series = {}
        for r in d.get("results", []):
            if r.get("mode") == "steady" and "error" not in r:
                series.setdefault(r["backend"], []).append((r["context"], r["tokens_per_s"], r["batch"]))
        for be, pts in sorted(series.items()):
            pts.sort()
            tag = f"{be} (tp {d.get('tp')})" if d.get("tp", 1) > 1 else be
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tag)
            for x, y, b in pts:
                ax.annotate(f"b{b}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
            drawn += 1
    if not drawn:
        return
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (batch from the KV budget)")
    dev = docs[0][1].get("device")
    ax.set_title(f"Llama-3-8B-shaped decode, one KV budget: {dev}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
