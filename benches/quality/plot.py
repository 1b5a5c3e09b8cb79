#!/usr/bin/env python3
"""Merge quality JSONs (eval.py outputs) and draw the frontier PNG.

    python benches/quality/plot.py a.json b.json --out benches/results/quality-h100-DATE.json

writes the merged JSON (schemes of later files override earlier ones of the same name) and a
PNG beside it: perplexity (mean over the evaluation texts) against resident bytes per token per
kv head, one panel per context, one marker per scheme (hollow: pure-torch simulation; filled:
kvforge kernels), plus needle score and layer error. The seeds' claims (seed_claims.json) are
printed in a side box, labelled QUOTED: they are on other models and are not on our axes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

FAMILY = [  # (substring of the scheme name, colour, marker)
    ("fp8", "tab:cyan", "v"),
    ("rotated", "tab:brown", "P"), ("sim:r", "tab:brown", "P"), ("sim:k", "tab:brown", "P"),
    ("spherical", "tab:purple", "o"),
    ("certified", "tab:green", "D"),
    ("int8", "tab:blue", "s"), ("b8", "tab:blue", "s"),
    ("int4", "tab:orange", "s"), ("b4", "tab:orange", "s"),
    ("int2", "tab:red", "s"), ("b2", "tab:red", "s"),
    ("baseline", "black", "*"), ("b16", "black", "*"), ("fp16", "black", "*"),
]


def style(name: str):
    for key, colour, marker in FAMILY:
        if key in name:
            return colour, marker
    return "gray", "^"


def short(name: str) -> str:
    if name == "fp16":
        return "fp16 (ref)"
    kind, _, rest = name.partition(":")
    spec, _, tier = rest.rpartition(":")
    spec = Path(spec).stem if spec else ""
    return f"{spec}:{tier}" if spec else rest


def merge(paths: list[Path]) -> dict:
    out = None
    for p in paths:
        d = json.loads(Path(p).read_text())
        if out is None:
            out = d
            out["meta"]["merged_from"] = [str(p)]
            continue
        out["meta"]["merged_from"].append(str(p))
        out["schemes"].update(d.get("schemes", {}))
        if "baseline_check" in d:
            out["baseline_check"] = d["baseline_check"]
    return out


def plot(paths: list[Path], png: Path, data: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = data or merge(paths)
    schemes = {k: v for k, v in data["schemes"].items() if "skipped" not in v}
    contexts = sorted({int(c) for s in schemes.values() for c in s.get("perplexity", {})})
    ncol = max(3, len(contexts))
    fig, axes = plt.subplots(2, ncol, figsize=(5.2 * ncol, 9.5), squeeze=False)
    ref = schemes.get("fp16")

    for i, ctx in enumerate(contexts):
        ax = axes[0][i]
        for name, s in schemes.items():
            row = s.get("perplexity", {}).get(str(ctx), {})
            if "mean" not in row:
                continue
            colour, marker = style(name)
            filled = s.get("kind") != "sim"
            ax.scatter(s["bytes_per_token_per_kv_head"], row["mean"], c=colour if filled else "none",
                       edgecolors=colour, marker=marker, s=90 if marker == "*" else 55, zorder=3)
            ax.annotate(("" if filled else "sim ") + short(name), (s["bytes_per_token_per_kv_head"], row["mean"]),
                        fontsize=7, xytext=(4, 3), textcoords="offset points")
        if ref and str(ctx) in ref.get("perplexity", {}):
            ax.axhline(ref["perplexity"][str(ctx)]["mean"], color="black", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("resident bytes / token / kv head (K+V)")
        ax.set_ylabel("perplexity (mean over texts, log)")
        ax.set_title(f"context {ctx}")
        ax.grid(alpha=0.3)
    for j in range(len(contexts), ncol):
        axes[0][j].axis("off")

    ax = axes[1][0]
    for name, s in schemes.items():
        nd = s.get("needle")
        if not nd or nd.get("score") is None:
            continue
        colour, marker = style(name)
        filled = s.get("kind") != "sim"
        ax.scatter(s["bytes_per_token_per_kv_head"], nd["score"], c=colour if filled else "none", edgecolors=colour, marker=marker)
        ax.annotate(short(name), (s["bytes_per_token_per_kv_head"], nd["score"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("bytes / token / kv head")
    ax.set_ylabel("needle exact-match rate")
    ax.set_title("needle in a haystack (all contexts, depths)")
    ax.grid(alpha=0.3)

    ax = axes[1][1]
    for name, s in schemes.items():
        le = s.get("layer_error")
        if not le:
            continue
        ctx = sorted(le, key=int)[-1]
        colour, marker = style(name)
        ax.plot(le[ctx]["rel_err_per_layer"], color=colour, marker=marker, ms=3, lw=1,
                ls="-" if s.get("kind") != "sim" else ":", label=f"{short(name)} @{ctx}")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("||o - o_fp16|| / ||o_fp16||")
    ax.set_title("attention output error vs fp16 (same inputs)")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)

    ax = axes[1][2]
    ax.axis("off")
    claims = json.loads((HERE / "seed_claims.json").read_text())["claims"]
    lines = ["QUOTED from the seeds (other models and texts;", "not measured by us, not on these axes):", ""]
    for c in claims:
        lines.append(f"[{c['seed']}] {c['quote']}")
    import textwrap

    ax.text(0, 1, "\n".join(textwrap.fill(l, 62) if l else l for l in lines), va="top", fontsize=7, family="monospace")
    for j in range(3, ncol):
        axes[1][j].axis("off")

    m = data["meta"]
    fig.suptitle(f"SmolLM2-135M-Instruct KV-cache schemes, MEASURED by us on {m['device']} ({m['date']}, {m['dtype']}); "
                 "filled: kvforge kernels, hollow: torch simulation, dashed: fp16", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, help="merged JSON (default: the first input, PNG beside it)")
    args = ap.parse_args()
    data = merge(args.inputs)
    out = args.out or args.inputs[0]
    if args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
        print(f"wrote {out}")
    plot(args.inputs, out.with_suffix(".png"), data)


if __name__ == "__main__":
    main()
