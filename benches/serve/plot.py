#!/usr/bin/env python3
"""Tables and a plot of serving results (``run.py`` JSONs): tokens/s vs context per backend.

    python3 benches/serve/plot.py results/*.json --out serve.png

Prints one markdown table per file (steady / tpot / loop / quality rows); draws tokens/s
against context on log axes per backend from the steady rows when matplotlib is importable:
one panel per GPU count (one GPU; two GPUs from a ``tp2`` JSON, tokens/s of the whole
tensor-parallel group), the same backend in the same colour in each, ``+graph`` where its steps
were replayed from a CUDA graph (``run.py --cuda-graph``).
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
        print("| mode | backend | context | batch | tokens/s | ms/step | attention ms/step | kv write ms/step | bytes/token | CUDA graph |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in steady:
            if "error" in r:
                print(f"| {r['mode']} | {r['backend']} | {r['context']} | | error: {r['error'][:80]} | | | | | |")
                continue
            print(f"| {r['mode']} | {r['backend']} | {r['context']} | {r['batch']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
                  f"{r.get('attn_ms_per_step') or 0:.2f} | {r.get('kv_write_ms_per_step') or 0:.2f} | {r['bytes_per_token']:.0f} | {graph_cell(r)} |")
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


def graph_cell(r) -> str:
    """The CUDA-graph column: no / yes (captures, eager steps in the timed window)."""
    if not r.get("cuda_graph"):
        return "no" + (f" ({r['cuda_graph_error'][:60]})" if r.get("cuda_graph_error") else "")
    return f"yes ({r.get('graph_captures', 0)} captures, {r.get('graph_eager_steps', 0)} eager steps)"


def label(r) -> str:
    """A backend's series name: ``+graph`` where its steps replayed a CUDA graph."""
    return r["backend"] + (" +graph" if r.get("cuda_graph") else "")


def series(docs):
    """{GPU count: {series name: [(context, tokens/s, batch)]}} from the steady rows of every
    (name, doc), contexts ascending; a (GPU count, series, context) measured in several files
    keeps the last file's point."""
    out = {}
    for _, d in docs:
        tp = int(d.get("tp", 1) or 1)
        for r in d.get("results", []):
            if r.get("mode") == "steady" and "error" not in r:
                out.setdefault(tp, {}).setdefault(label(r), {})[r["context"]] = (r["context"], r["tokens_per_s"], r["batch"])
    return {tp: {be: sorted(pts.values()) for be, pts in sorted(by.items())} for tp, by in sorted(out.items())}


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
    by_tp = series(docs)
    if not by_tp:
        return
    names = sorted({be for by in by_tp.values() for be in by})
    colors = {be: f"C{i % 10}" for i, be in enumerate(names)}
    fig, axes = plt.subplots(1, len(by_tp), figsize=(6.5 * len(by_tp), 4.5), sharey=True, squeeze=False)
    for ax, (tp, by) in zip(axes[0], by_tp.items()):
        for be, pts in by.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[be], label=be,
                    linestyle="--" if be.endswith("+graph") else "-")
            for x, y, b in pts:
                ax.annotate(f"b{b}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"{tp} GPU{'s' if tp > 1 else ''}" + (" (tensor parallel)" if tp > 1 else "") + ", KV budget per GPU")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("decode tokens/s (batch from the KV budget)")
    dev = docs[0][1].get("device")
    fig.suptitle(f"Llama-3-8B-shaped decode, tokens/s vs context: {dev}")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
