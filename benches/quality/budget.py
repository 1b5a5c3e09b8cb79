#!/usr/bin/env python3
"""Tier controllers on a real model: perplexity and retrieval of SmolLM2-135M-Instruct when
kvforge's RDR and RDKV controllers hold each layer's KV cache to a byte budget (5–50% of fp16),
next to uniform int8/int4/int2, certified decode and exact fp16, all on the GPU cache.

Protocol (what a serving system does): the first ``ctx - cont`` tokens of a text are the
prompt, attended exactly (the prefill reads the fresh fp16 K/V) while they are stored in the
kvforge cache (full pages in the spec's first ladder tier, b8); each layer's controller then
re-codes and drops pages to the budget, weighing tokens by the prompt's attention column sums;
the last ``cont`` tokens are scored against what the controller left (one forward of ``cont``
queries through ``attend_prefix``; certified decode goes one token at a time). Uniform schemes
store the prompt in their tier with the same exact prefill. Perplexity is over the ``cont``
tokens only; bytes are measured (resident page bytes over logical tokens, headers and the fp16
tail page included, after scoring: the continuation's own pages count). Per-layer attention
error: ‖o − o_exact‖/‖o_exact‖ of the continuation's queries in every layer, o_exact the exact
attention on the model's own K/V in that layer (same inputs).

    python benches/quality/budget.py --contexts 2048,8192 --png     # on the GPU, see README

The RDKV distortion tables ε(b) (seed 002 Table 14's role) are calibrated here on the
calibration text (emma, never evaluated): NMSE of this model's post-RoPE keys (per channel over
a 64-token page) and values (per token, groups of 32) at 8/4/2 bits, ε(16) = 0, ε(0) = 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
from frontier import relative  # noqa: E402
from kvq import log  # noqa: E402

SPEC = "specs/rdkv.toml"
TRIZONE = "specs/trizone.toml"
# Issue 26: the rotated ladder (r16 / r4 / r3 / k3v2 / r2), RDKV with its own ε tables (bits 4, 3, 2).
ROTATED = "specs/rotated.toml"
EVAL_TEXTS = ["persuasion", "northangerabbey", "mansfieldpark", "sensesensibility", "prideprejudice"]
FRACTIONS = [0.05, 0.1, 0.2, 0.35, 0.5]


class Capture(kvq.Fp16Backend):
    """Exact attention that keeps every layer's K/V (for calibration)."""

    def __init__(self):
        self.kv = {}

    def attend(self, layer, q, k, v, scaling):
        self.kv[layer] = (k.detach().float(), v.detach().float())
        return super().attend(layer, q, k, v, scaling)


@torch.no_grad()
def calibrate(model, ids, device) -> dict:
    """RDKV ε tables from the calibration text's K/V (NMSE summed over layers and heads)."""
    cap = Capture()
    kvq.set_backend(cap)
    model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    def tables(spec: str, tiers) -> tuple:
        eps_k, eps_v = {16: 0.0, 0: 1.0}, {16: 0.0, 0: 1.0}
        for bits, tier in tiers:
            sim = kvq.TierSim(kvq.ROOT / spec, tier)
            ek = ev = nk = nv = 0.0
            for k, v in cap.kv.values():
                t = (k.shape[1] // sim.page) * sim.page
                k, v = k[:, :t], v[:, :t]
                ek += (sim.keys(k) - k).pow(2).sum().item()
                ev += (sim.values(v) - v).pow(2).sum().item()
                nk += k.pow(2).sum().item()
                nv += v.pow(2).sum().item()
            eps_k[bits], eps_v[bits] = ek / nk, ev / nv
        return eps_k, eps_v

    eps_k, eps_v = tables(SPEC, ((8, "b8"), (4, "b4"), (2, "b2")))
    rot_k, rot_v = tables(ROTATED, ((4, "r4"), (3, "r3"), (2, "r2")))
    return {"eps_k": eps_k, "eps_v": eps_v, "eps_k_rotated": rot_k, "eps_v_rotated": rot_v, "tokens": len(ids),
            "text": kvq.CALIBRATION_BOOK}


@torch.no_grad()
def continuation(model, ids, cont: int, device, one_by_one: bool = False) -> float:
    """Summed NLL of the last ``cont`` tokens of ``ids`` after a forward of the rest."""
    prefix, tail = ids[:-cont], ids[-cont:]
    out = model(input_ids=torch.tensor([prefix], device=device), use_cache=True)
    past, last = out.past_key_values, out.logits[0, -1:]
    y = torch.tensor([tail], device=device)
    if one_by_one:
        logits = [last]
        for i in range(cont - 1):
            o = model(input_ids=y[:, i:i + 1], past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits.append(o.logits[0, -1:])
        logits = torch.cat(logits, 0)
    else:
        o = model(input_ids=y, past_key_values=past, use_cache=True)
        logits = torch.cat([last, o.logits[0, :-1]], 0)
    return F.cross_entropy(logits.float(), y[0], reduction="sum").item()


def make(scheme: str, d: int, calib: dict, max_tokens: int, args):
    """fp16 | uniform:<tier> | rotated:<tier> | rdr@<frac> | rdkv@<frac> | trizone@<frac> |
    rotated@<frac> | certified

    ``trizone@f``: RDKV on specs/trizone.toml (seed 002's TriZone: per-channel mixed-bit keys in
    the prompt's channel order, per-page value widths), pages start in zone B (``zb``).
    ``rotated@f``: RDKV on the rotated ladder of specs/rotated.toml (issue 26), pages start in r16
    (fp16 in the rotated basis) and the protected sinks and recent pages stay there (floor r16:
    the fp16 window the rotated codes need), ε tables of the rotated codes; ``rotated:<tier>``
    stores every page in that tier."""
    import kvforge.hf as hf

    if scheme == "fp16":
        return kvq.Fp16Backend()
    if scheme.startswith("uniform:"):
        return kvq.KvforgeBackend(SPEC, scheme.split(":")[1], scheme, max_tokens, exact_prefill=True)
    if scheme.startswith("rotated:"):
        return kvq.KvforgeBackend(ROTATED, scheme.split(":")[1], scheme, max_tokens, exact_prefill=True)
    if scheme == "certified":
        import kvforge

        return kvq.KvforgeBackend("specs/certified.toml", "q8k4v", scheme, max_tokens, exact_prefill=True,
                                  certify=kvforge.Certifier())
    policy, _, frac = scheme.partition("@")
    budget = float(frac) * 4.0 * d  # bytes per token per kv head; fp16 K + V = 4d
    spec, start, floor = {"trizone": (TRIZONE, "zb", "za2"), "rotated": (ROTATED, "r16", "r16")}.get(policy, (SPEC, "b8", "b2"))
    kw = dict(sinks=args.sinks, recent=args.recent, floor=floor)
    if policy == "rotated":
        # A dropped token's ε (NMSE 1 by default); larger keeps every page coded (floor r2).
        drop = {0: args.rotated_drop_eps}
        kw.update(eps_k={**calib["eps_k_rotated"], **drop}, eps_v={**calib["eps_v_rotated"], **drop})
    elif policy in ("rdkv", "trizone"):
        kw.update(eps_k=calib["eps_k"], eps_v=calib["eps_v"])
    control = "rdkv" if policy in ("trizone", "rotated") else policy
    return kvq.KvforgeBackend(spec, start, scheme, max_tokens, control=hf.Control(control, budget, observe=args.observe,
                                                                                 observe_weight=args.observe_weight, keep=args.keep,
                                                                                 share=args.share, share_radius=args.share_radius, **kw))


def summarise_reports(backend) -> dict:
    reps = list(getattr(backend, "reports", {}).values())
    if not reps:
        return {}
    return {"dropped_pages": sum(r.dropped for r in reps), "retiered_pages": sum(r.retiered for r in reps),
            "bytes_after_over_budget": max(r.bytes_after / r.budget_bytes for r in reps if r.budget_bytes > 0),
            "feasible": all(r.feasible for r in reps), "decide_ms_mean": 1e3 * statistics.mean(r.decide_seconds for r in reps),
            "apply_ms_mean": 1e3 * statistics.mean(r.apply_seconds for r in reps),
            "duality_gap_max": max(r.duality_gap for r in reps)}


def save(out: Path, meta: dict, calib: dict, rows: list, needle: dict) -> dict:
    """Writes the JSON (after every scheme: partial results survive a timeout)."""
    agg = {}
    for r in rows:
        a = agg.setdefault(r["scheme"], {}).setdefault(str(r["context"]), {"ppl": [], "bytes_fraction": []})
        a["ppl"].append(r["ppl"])
        a["bytes_fraction"].append(r["bytes_fraction"])
    summary = {s: {c: {"ppl_mean": statistics.mean(v["ppl"]), "bytes_fraction_mean": statistics.mean(v["bytes_fraction"]),
                       "texts": len(v["ppl"])} for c, v in by.items()} for s, by in agg.items()}
    result = {"meta": meta, "calibration": calib, "summary": summary, "needle": needle, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--data", type=Path, default=kvq.DATA)
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--texts", default=",".join(EVAL_TEXTS))
    ap.add_argument("--cont", type=int, default=256, help="scored continuation tokens")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="budgets, fraction of fp16 bytes")
    ap.add_argument("--uniform", default="b8,b4,b2")
    ap.add_argument("--trizone", default="0.2,0.35,0.5", help="budgets of RDKV on the TriZone spec ('' skips)")
    ap.add_argument("--rotated", default="0.2,0.35", help="budgets of RDKV on the rotated ladder ('' skips)")
    ap.add_argument("--uniform-rotated", default="r3", help="rotated tiers stored uniformly ('' skips)")
    ap.add_argument("--certified-contexts", default="2048", help="contexts for certified decode ('' skips)")
    ap.add_argument("--certified-texts", type=int, default=2, help="first N texts for certified decode")
    ap.add_argument("--needle-context", type=int, default=4096, help="0 skips the needle test")
    ap.add_argument("--needle-depths", default="0.2,0.5,0.8")
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--observe", type=int, default=None,
                    help="weigh tokens by the attention of the prompt's last N queries only (SnapKV's observation window)")
    ap.add_argument("--observe-weight", type=float, default=1.0,
                    help="with --observe: the window's share of the token weights, the rest the whole prompt's")
    ap.add_argument("--keep", type=int, default=0,
                    help="with --observe: positions per kv head the window attends most, weighted to keep their bytes")
    ap.add_argument("--share", type=int, default=0,
                    help="with --observe: the window's top positions per layer and kv head whose pages weigh the head's mass in every layer")
    ap.add_argument("--share-radius", type=int, default=0, help="with --share: also the pages within this many positions")
    ap.add_argument("--rotated-drop-eps", type=float, default=1.0,
                    help="NMSE RDKV charges a dropped token on the rotated ladder (1: as calibrated; 1e6: never drop)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--png", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("budget.py runs kvforge's GPU cache: it needs CUDA")
    device = "cuda"
    contexts = [int(x) for x in args.contexts.split(",") if x]  # '' runs only certified / needle
    texts = [t for t in args.texts.split(",") if t]
    if kvq.CALIBRATION_BOOK in texts:
        raise SystemExit(f"{kvq.CALIBRATION_BOOK} calibrates; it is not evaluated")
    fracs = [float(x) for x in args.fractions.split(",") if x]
    schemes = ["fp16"] + [f"uniform:{t}" for t in args.uniform.split(",") if t]
    schemes += [f"{p}@{f}" for p in ("rdr", "rdkv") for f in fracs]
    schemes += [f"trizone@{f}" for f in [float(x) for x in args.trizone.split(",") if x]]
    schemes += [f"rotated:{t}" for t in args.uniform_rotated.split(",") if t]
    schemes += [f"rotated@{f}" for f in [float(x) for x in args.rotated.split(",") if x]]
    cert_ctx = [int(x) for x in args.certified_contexts.split(",") if x]

    gguf = kvq.find_gguf(args.model)
    model, tok = kvq.load_model(gguf, device, torch.float16)
    d = model.config.head_dim
    hkv = model.config.num_key_value_heads
    toks = {t: kvq.book_tokens(tok, t, args.data) for t in set(texts + [kvq.CALIBRATION_BOOK, "northangerabbey"])}
    t0 = time.time()
    calib = calibrate(model, toks[kvq.CALIBRATION_BOOK][:2048], device)
    log(f"calibrated RDKV tables on {kvq.CALIBRATION_BOOK}: eps_k {calib['eps_k']} eps_v {calib['eps_v']}")
    max_tokens = max(contexts + cert_ctx + [args.needle_context]) + 256
    import kvforge

    dev_name = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", dev_name.lower().replace("nvidia", "")).strip("-").split("-")[0]
    date = dt.date.today().isoformat()
    out = args.out or (kvq.ROOT / "benches" / "results" / f"budget-{slug}-{date}.json")
    import transformers

    meta = {"what": "continuation perplexity (last `cont` tokens) and needle retrieval under kvforge tier controllers; all measured by this run",
            "device": dev_name, "date": date, "torch": torch.__version__, "transformers": transformers.__version__,
            "kvforge": kvforge.__version__, "model": gguf.name, "spec": SPEC, "head_dim": d, "kv_heads": hkv,
            "fp16_bytes_per_token": 4.0 * d, "protection": {"sinks": args.sinks, "recent": args.recent, "floor": {"rdr/rdkv": "b2", "trizone": "za2", "rotated": "r16"}},
            "protocol": __doc__.split("\n\n")[1], "argv": sys.argv[1:]}
    rows, needle = [], {}
    for scheme in (schemes if contexts else []) + (["certified"] if cert_ctx else []):
        backend = make(scheme, d, calib, max_tokens, args)
        for ctx in (cert_ctx if scheme == "certified" else contexts):
            for ti, text in enumerate(texts):
                if scheme == "certified" and ti >= args.certified_texts:
                    continue
                ids = toks[text][:ctx]
                kvq.set_backend(backend)
                cert, layer_err = [], {}
                if scheme not in ("fp16", "certified"):
                    orig = backend.attend

                    def attend(layer, q, k, v, scaling, orig=orig):  # attention error vs exact, same inputs
                        out = orig(layer, q, k, v, scaling)
                        if q.shape[1] < k.shape[1]:  # the scored continuation, not the prompt
                            ref, _ = kvq.hf.exact_attention(q, k, v, scaling)
                            layer_err[layer] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        return out
                    backend.attend = attend
                if scheme == "certified":
                    orig = backend.attend

                    def attend(layer, q, k, v, scaling, orig=orig):  # collect every step's certificates
                        out = orig(layer, q, k, v, scaling)
                        if q.shape[1] == 1:
                            cert.extend(backend.certificates[layer])
                        return out
                    backend.attend = attend
                ts = time.time()
                nll = continuation(model, ids, args.cont, device, one_by_one=scheme == "certified")
                if scheme != "fp16":
                    backend.attend = orig
                row = {"scheme": scheme, "context": ctx, "text": text, "cont": args.cont, "nll": nll,
                       "ppl": math.exp(nll / args.cont), "seconds": time.time() - ts}
                if scheme != "fp16":
                    row["bytes_per_token"] = backend.bytes_per_token(d)
                    row["bytes_fraction"] = row["bytes_per_token"] / (4.0 * d)
                    row.update(summarise_reports(backend))
                else:
                    row["bytes_per_token"], row["bytes_fraction"] = 4.0 * d, 1.0
                if layer_err:
                    row["attn_rel_err_per_layer"] = [layer_err[i] for i in sorted(layer_err)]
                    row["attn_rel_err_mean"] = statistics.mean(layer_err.values())
                if cert:
                    b = sorted(c.bound for c in cert)
                    row["certificates"] = {"head_steps": len(cert), "bound_p50": b[len(b) // 2], "bound_max": b[-1],
                                           "rungs": {str(r): sum(c.rung == r for c in cert) for r in range(5)},
                                           "promoted_mean": statistics.mean(c.promoted for c in cert),
                                           "detections": sum(c.detections for c in cert)}
                rows.append(row)
                log(f"{scheme:>12} ctx {ctx:5d} {text:>16}: ppl {row['ppl']:8.3f}  bytes {row['bytes_per_token']:6.1f}"
                    f" ({row['bytes_fraction']:.3f})  attn err {row.get('attn_rel_err_mean', 0):.4f}  {row['seconds']:.1f}s")
        meta["seconds"] = time.time() - t0
        save(out, meta, calib, rows, needle)

    if args.needle_context:
        import eval as ev  # the needle prompt and trial of the main harness

        depths = [float(x) for x in args.needle_depths.split(",") if x]
        for scheme in schemes:
            backend = make(scheme, d, calib, max_tokens, args)
            hits = []
            for depth in depths:
                code = 1000 + int(depth * 7919) % 9000
                ids, pos = ev.needle_prompt(tok, toks["northangerabbey"], args.needle_context, depth, code)
                kvq.set_backend(backend)
                answer = ev.needle_trial(model, tok, ids, device)
                hits.append(str(code) in re.findall(r"\d+", answer))
            needle[scheme] = {"context": args.needle_context, "depths": depths, "hits": hits,
                              "score": sum(hits) / len(hits)}
            log(f"needle {scheme:>12}: {''.join('x' if h else '.' for h in hits)}")
            save(out, meta, calib, rows, needle)

    meta["seconds"] = time.time() - t0
    result = save(out, meta, calib, rows, needle)
    log(f"wrote {out}")
    if args.png:
        plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """Perplexity relative to fp16 (same texts) vs measured bytes, one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rel = relative(result["rows"])
    ctxs = sorted({c for by in rel.values() for c in by})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        for label, pre, style in (("RDR", "rdr@", "o-"), ("RDKV", "rdkv@", "s-"), ("RDKV TriZone", "trizone@", "D-"), ("uniform int8/4/2", "uniform:", "^--")):
            pts = sorted(v[ctx] for s, v in rel.items() if s.startswith(pre) and ctx in v)
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        if ctx in rel.get("certified", {}):
            ax.plot(*rel["certified"][ctx], "*", ms=12, label="certified q8k4v")
        ax.axhline(1.0, color="k", lw=0.8, ls=":", label="fp16")
        ax.set_yscale("log")
        ax.set_xlabel("resident bytes / fp16 bytes (measured)")
        ax.set_ylabel("continuation perplexity / fp16")
        ax.set_title(f"SmolLM2-135M, context {ctx}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = result["meta"]
    fig.suptitle(f"kvforge tier controllers on {m['device']}, {m['date']} (all points measured)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
