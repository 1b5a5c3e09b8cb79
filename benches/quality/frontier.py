#!/usr/bin/env python3
"""The quality frontier of every KV scheme kvforge has measured on SmolLM2: perplexity relative
to fp16 against bytes relative to fp16, one panel per context, from committed result files (no
GPU, no torch: it reads JSON).

Two protocols, drawn apart and never mixed in one line:
- ``--budget`` files (``budget.py``): continuation perplexity (the last 256 tokens of each
  window) under the tier controllers and the uniform tiers, bytes *measured* after scoring
  (headers, sinks, the recent window and the continuation's fp16 pages included). A file may
  carry a label for its controller rows: ``FILE=LABEL``.
- ``--sim`` files (``eval.py``): whole-window perplexity of uniformly coded caches (simulated
  in torch), bytes *computed* (payload + scales of full pages; an fp16 sink / recent window in
  the scheme's name is not counted), among them FlashInfer's fp8 e4m3 KV (``sim:fp8``).
  ``FILE=s1,s2`` keeps those schemes only.
- ``--kernel`` files (``kernel_ppl.py``): teacher-forced perplexity through the kvforge kernels,
  one decode step per token, uniform tiers with their fp16 sink and recent pages, bytes
  *measured* (resident bytes per token per kv head ÷ 256, SmolLM2's fp16 K+V at head dim 64).

Each ratio is the mean over texts of ppl ÷ fp16 ppl of the same text and context (fp16 from the
same file).

    python3 benches/quality/frontier.py \\
        --budget benches/results/budget-trizone-h100-2026-11-23.json \\
        --budget benches/results/budget-rotated-r16-observe64-share4-h200-2026-11-29.json="share 4" \\
        --sim benches/results/quality-rotated-sim-h200-2026-11-27.json=sim:fp8 \\
        --kernel benches/results/quality-kernel-v18-h200-2026-11-29.json \\
        --out benches/results/frontier-h200-2026-11-29.png --md frontier.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Controller and uniform rows of budget.py, by scheme prefix: legend label, matplotlib style.
POLICIES = (
    ("rdr@", "RDR (int ladder)", "o-"),
    ("rdkv@", "RDKV (int ladder)", "s-"),
    ("trizone@", "RDKV TriZone", "D-"),
    ("rotated@", "RDKV rotated ladder", "v-"),
    ("uniform:", "uniform int8 / int4 / int2", "^--"),
)
# Legend names of eval.py schemes that are not kvforge's own (others keep their scheme name).
SIM_NAMES = {"sim:fp8": "FlashInfer fp8 e4m3"}
# fp16 K + V bytes per token per kv head of SmolLM2 (head dim 64): kernel_ppl's denominator.
FP16_BYTES = 256.0
# Top of the plots' perplexity axis (linear): the interesting region is within a few percent.
YMAX = 1.3


def relative(rows: list) -> dict:
    """scheme -> context -> (mean bytes fraction, mean over texts of ppl / fp16 ppl of the same
    text and context): schemes run on different text subsets stay comparable."""
    ref = {(r["context"], r["text"]): r["ppl"] for r in rows if r["scheme"] == "fp16"}
    out: dict = {}
    for r in rows:
        key = (r["context"], r["text"])
        if r["scheme"] != "fp16" and key in ref:
            out.setdefault(r["scheme"], {}).setdefault(r["context"], []).append((r["bytes_fraction"], r["ppl"] / ref[key]))
    return {s: {c: (statistics.mean(x[0] for x in v), statistics.mean(x[1] for x in v)) for c, v in by.items()} for s, by in out.items()}


def sim_relative(result: dict) -> dict:
    """eval.py's result -> scheme -> context -> (computed bytes fraction, mean over texts of
    ppl / fp16 ppl)."""
    schemes = result["schemes"]
    ref = schemes["fp16"]["perplexity"]
    out: dict = {}
    for name, s in schemes.items():
        if name == "fp16" or "perplexity" not in s:
            continue
        for ctx, by_text in s["perplexity"].items():
            ratios = [p / ref[ctx][t] for t, p in by_text.items() if t != "mean" and t in ref.get(ctx, {})]
            if ratios:
                out.setdefault(name, {})[int(ctx)] = (s["bytes_fraction_of_fp16"], statistics.mean(ratios))
    return out


def kernel_relative(result: dict) -> dict:
    """kernel_ppl.py's result -> tier -> context -> (measured bytes fraction, mean over texts of
    ppl / eager fp16 ppl)."""
    out: dict = {}
    for name, t in result["tiers"].items():
        if t.get("tier") == "fp16":
            continue
        for ctx, c in t.get("contexts", {}).items():
            texts = list(c.get("texts", {}).values())
            if texts:
                out.setdefault(name, {})[int(ctx)] = (
                    statistics.mean(x["bytes_per_token_per_kv_head"] for x in texts) / FP16_BYTES,
                    statistics.mean(x["ratio"] for x in texts),
                )
    return out


def series(budget: list, sims: list, kernels: list = ()) -> list:
    """Every line and point of the plot: dicts with label, style, protocol and {context:
    [(bytes, ratio), ...]} sorted by bytes. Files whose rows get the same label (a budget run
    split over calls) make one line."""
    out: list = []
    by_label: dict = {}

    def add(label, style, protocol, path, points):
        if label in by_label:
            s = by_label[label]
            s["file"] += f", {path}"
            for c, v in points.items():
                s["points"][c] = sorted(s["points"].get(c, []) + v)
        else:
            by_label[label] = {"label": label, "style": style, "protocol": protocol, "file": path, "points": {c: sorted(v) for c, v in points.items()}}
            out.append(by_label[label])

    for path, label, result in budget:
        rel = relative(result["rows"])
        dev = result["meta"].get("device", "?").replace("NVIDIA ", "")
        for pre, name, style in POLICIES:
            pts: dict = {}
            for scheme, by in rel.items():
                if scheme.startswith(pre):
                    for ctx, p in by.items():
                        pts.setdefault(ctx, []).append(p)
            if pts:
                tag = f"{name}{f', {label}' if label else ''} ({dev})"
                add(tag, style, "budget", path, pts)
        if "certified" in rel:
            add(f"certified q8k4v ({dev})", "*", "budget", path, {c: [p] for c, p in rel["certified"].items()})
    for path, keep, result in sims:
        rel = sim_relative(result)
        dev = result["meta"].get("device", "?").replace("NVIDIA ", "")
        for scheme, by in rel.items():
            if not keep or scheme in keep:
                name = SIM_NAMES.get(scheme, scheme.removeprefix("sim:"))
                add(f"{name}, simulated ({dev})", "x", "sim", path, {c: [p] for c, p in by.items()})
    for path, result in kernels:
        dev = result.get("device", "?").replace("NVIDIA ", "")
        for tier, by in kernel_relative(result).items():
            name = tier.split(":")[-1]
            add(f"{name} through the kernels, fp16 sink + recent pages ({dev})", "P", "kernel", path, {c: [p] for c, p in by.items()})
    return out


def table(lines: list) -> str:
    """A markdown table: one row per point."""
    rows = ["| series | context | bytes / fp16 | ppl / fp16 | protocol | file |", "|---|---:|---:|---:|---|---|"]
    for s in lines:
        files = ", ".join(f"`{Path(f).name}`" for f in s["file"].split(", "))
        for ctx in sorted(s["points"]):
            for b, r in s["points"][ctx]:
                rows.append(f"| {s['label']} | {ctx} | {b:.3f} | {r:.4f} | {s['protocol']} | {files} |")
    return "\n".join(rows) + "\n"


def plot(lines: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({c for s in lines for c in s["points"]})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(6 * len(ctxs), 5), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        for s in lines:
            pts = s["points"].get(ctx)
            if pts:
                kw = {"ms": 9, "mew": 2} if s["protocol"] != "budget" else {}
                # Points above the axis sit on its top edge with their value written beside.
                shown = [(b, min(r, YMAX)) for b, r in pts]
                (line,) = ax.plot(*zip(*shown), s["style"], label=s["label"], **kw)
                for b, r in pts:
                    if r > YMAX:
                        ax.annotate(f"{r:.2f}", (b, YMAX), textcoords="offset points", xytext=(4, -10), fontsize=7, color=line.get_color())
        ax.axhline(1.0, color="k", lw=0.8, ls=":", label="fp16")
        ax.set_ylim(0.99, YMAX + 0.01)
        ax.set_xlabel("bytes / fp16 bytes (controllers, kernels: measured; simulated: computed)")
        ax.set_ylabel("perplexity / fp16")
        ax.set_title(f"SmolLM2-135M, context {ctx}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", action="append", default=[], help="budget.py JSON, optionally FILE=LABEL")
    ap.add_argument("--sim", action="append", default=[], help="eval.py JSON (uniform tiers, whole-window perplexity), optionally FILE=scheme,scheme")
    ap.add_argument("--kernel", action="append", default=[], help="kernel_ppl.py JSON (uniform tiers through the kernels)")
    ap.add_argument("--out", type=Path, help="PNG to write")
    ap.add_argument("--md", type=Path, help="markdown table to write (default: print)")
    a = ap.parse_args()
    if not a.budget and not a.sim and not a.kernel:
        ap.error("give at least one --budget, --sim or --kernel file")
    budget = []
    for spec in a.budget:
        path, _, label = spec.partition("=")
        budget.append((path, label, load(path)))
    sims = []
    for spec in a.sim:
        path, _, keep = spec.partition("=")
        sims.append((path, {k for k in keep.split(",") if k}, load(path)))
    kernels = [(p, load(p)) for p in a.kernel]
    lines = series(budget, sims, kernels)
    md = table(lines)
    if a.md:
        a.md.write_text(md)
    else:
        print(md, end="")
    if a.out:
        plot(lines, a.out, "kvforge KV schemes on SmolLM2: perplexity vs bytes (every point measured; files in the table)")
        print(f"wrote {a.out}")


def load(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"frontier.py: {path}: no such file")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"frontier.py: {path}:{e.lineno}: not JSON ({e.msg})")


if __name__ == "__main__":
    main()
