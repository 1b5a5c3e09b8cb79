"""Plot the quality-vs-bytes frontier written by `kvforge frontier --json`.

Usage: .venv/bin/python benches/frontier_plot.py benches/results/frontier-cpu-<date>.json [out.png]

One panel per (context, error metric): attention output relative error (log) against resident
bytes per token per kv head. Controllers are curves over their budget sweep; uniform
quantisation is one marker per tier (filled: every page in the tier; hollow: protected pages
kept in the first tier, as the controllers keep them). Points where protection alone exceeds
the budget are absent.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CURVE_STYLE = {
    "RDR (rdkv ladder)": dict(color="tab:red", marker="o"),
    "RDR (spherical ladder)": dict(color="tab:purple", marker="s"),
    "RDKV (pages, paper weights)": dict(color="tab:blue", marker="^"),
    "RDKV (pages, concentration)": dict(color="tab:cyan", marker="v"),
}
UNIFORM_COLOR = {"rdkv": "tab:green", "spherical": "tab:orange"}
UNIFORM_MARKER = {"b8": "D", "b4": "P", "b2": "X", "high": "h", "mid": "p", "low": "*"}


def main() -> None:
    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    rows = [r for r in data["results"] if r["feasible"]]
    contexts = sorted({r["context"] for r in rows})
    metrics = [("rel_error_mean", "mean over query rows of ‖o − ô‖/‖o‖"), ("rel_error_pooled", "pooled ‖O − Ô‖ / ‖O‖")]
    fig, axes = plt.subplots(len(contexts), len(metrics), figsize=(13, 4.6 * len(contexts) + 1.2), squeeze=False)
    for i, ctx in enumerate(contexts):
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j]
            here = [r for r in rows if r["context"] == ctx]
            for name, style in CURVE_STYLE.items():
                pts = sorted({(r["bytes_per_token"], r[key]) for r in here if r["method"] == name})
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, lw=1.6, ms=4, **style)
            for r in here:
                if not r["uniform"]:
                    continue
                tier = r["method"].split(":")[1].split(" ")[0]
                keep = "protected" in r["method"]
                ax.plot(
                    r["bytes_per_token"],
                    r[key],
                    linestyle="none",
                    marker=UNIFORM_MARKER.get(tier, "o"),
                    ms=9,
                    color=UNIFORM_COLOR[r["spec"]],
                    markerfacecolor="none" if keep else UNIFORM_COLOR[r["spec"]],
                    label=r["method"],
                )
            ax.set_yscale("log")
            ax.set_xlabel("resident bytes per token per kv head (fp16 = 514)")
            ax.set_ylabel(f"relative error ({label})")
            ax.set_title(f"{ctx} tokens × {here[0]['kv_heads']} kv heads, d 128")
            ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                handles, labels = ax.get_legend_handles_labels()
    s = data.get("setup", {})
    fig.suptitle(
        f"Attention output error vs bytes on synthetic attention with sinks, heavy hitters and needles "
        f"({len(s.get('seeds', []))} seeds, {s.get('keys', '?')} keys) — {data['device']}, {data['date']}",
        fontsize=10,
    )
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
