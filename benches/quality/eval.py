#!/usr/bin/env python3
"""Quality of every KV-cache scheme on SmolLM2-135M-Instruct: perplexity on Austen novels,
per-layer attention-output error against fp16, resident bytes per token, needle retrieval.

    python benches/quality/eval.py --schemes fp16,sim:int4 --contexts 512 --texts persuasion \\
        --needle-contexts 0 --device cpu --dtype fp32          # a short CPU smoke run

Every number in the output JSON is measured by this run (nothing is typed in); the seeds'
claims live in seed_claims.json and are only drawn, labelled "quoted", by plot.py.
See README.md for the device commands and the text preparation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
from kvq import log  # noqa: E402

EVAL_TEXTS = ["persuasion", "northangerabbey", "mansfieldpark", "sensesensibility", "prideprejudice"]
DEFAULT_SCHEMES = [
    "fp16",
    "sim:int8", "sim:int4", "sim:int2",
    "sim:specs/certified.toml:q8k4v",
    "sim:specs/spherical.toml:high", "sim:specs/spherical.toml:mid", "sim:specs/spherical.toml:low",
    "sim:fp8",
]
# issue 26: the rotated tiers of specs/rotated.toml (simulated, and the kernels), FlashInfer's
# fp8 KV cache beside them (simulated), and sim-tiers.toml's 2-bit variants outside the contract.
ROTATED_TIERS = ["r4", "r3", "r2"]
SCHEME_GROUPS = {
    "rotated-sim": ["sim:fp8"] + [f"sim:specs/rotated.toml:{t}" for t in ROTATED_TIERS],
    "rotated-kvforge": [f"kvforge:specs/rotated.toml:{t}" for t in ROTATED_TIERS],
    "rotated-variants": ["sim:k3v2", "sim:k4v2", "sim:r2-gauss", "sim:r2-norm", "sim:r2-sink64"],
    # kvtc (seed 003): needs $KVFORGE_KVTC_CAL and the kvforge binary (benches/quality/kvtc_on_device.sh)
    "kvtc": [f"sim:kvtc-{r}" for r in (4, 8, 16, 20, 32, 64)],
    # ParisKV (seed 001, issue 27): sinks + local + top-256 retrieved, and the exact top-256 (paris_sim.py)
    "paris": ["sim:paris-k256", "sim:paris-k256-oracle"],
    # the same, one retrieval per query head (paris_sim.py -qhead; the default is per kv head)
    "paris-qhead": ["sim:paris-k256-qhead", "sim:paris-k256-qhead-oracle"],
    # per kv head, candidates ranked by the group's largest head estimate (-hmax; the runtime's
    # Rank::GroupMax, its default), and the exact top-256 by the largest head logit
    "paris-hmax": ["sim:paris-k256-hmax", "sim:paris-k256-hmax-oracle"],
    # the runtime's default: -hmax on the 64 B summaries (-w64, SummaryLayout::Whole64)
    "paris-w64": ["sim:paris-k256-hmax-w64"],
}
KVFORGE_SCHEMES = [
    "kvforge:specs/baseline.toml:fp16",
    "kvforge:specs/rdkv.toml:b8", "kvforge:specs/rdkv.toml:b4", "kvforge:specs/rdkv.toml:b2",
    "kvforge:specs/certified.toml:q8k4v",
    "kvforge:specs/spherical.toml:high", "kvforge:specs/spherical.toml:mid", "kvforge:specs/spherical.toml:low",
]
NEEDLE = "The secret code of the blue door is {code}."
QUESTION = "What is the secret code of the blue door? Answer with the number only."


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def perplexity(model, ids: list[int], device) -> float:
    """exp(mean NLL) of tokens 1..n-1 given their prefix (one forward, no KV cache)."""
    x = torch.tensor([ids], device=device)
    out = model(input_ids=x, labels=x, use_cache=False)
    return math.exp(out.loss.float().item())


def needle_prompt(tok, hay_ids: list[int], ctx: int, depth: float, code: int) -> tuple[list[int], int]:
    """Chat-template prompt of about ``ctx`` tokens: Austen text with the needle sentence
    inserted at a line boundary at ``depth`` of the text, then the question. Returns
    (prompt ids, token position of the needle)."""
    def render(hay: str) -> list[int]:
        msgs = [{"role": "user", "content": hay + "\n\n" + QUESTION}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    overhead = len(render("")) + len(tok(NEEDLE.format(code=code) + "\n\n", add_special_tokens=False)["input_ids"])
    budget = max(16, ctx - overhead)
    hay = tok.decode(hay_ids[:budget])
    cut = len(tok.decode(hay_ids[: int(depth * budget)]))
    nl = hay.find("\n", cut)
    cut = len(hay) if nl < 0 else nl + 1
    text = hay[:cut] + NEEDLE.format(code=code) + "\n" + hay[cut:]
    ids = render(text)
    pos = len(render(hay[:cut])) - len(render("")) if cut else 0
    return ids, pos


@torch.no_grad()
def needle_trial(model, tok, ids: list[int], device, max_new: int = 24) -> str:
    x = torch.tensor([ids], device=device)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 2)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def run_scheme(name, model, tok, args, tokens, hay_ids, device, d):
    backend = kvq.make_backend(name, max_tokens=max(args.contexts + args.needle_contexts + [512]) + 64)
    res = {"scheme": name, **backend.describe(), "measured_by_us": True}
    t0 = time.time()

    # Perplexity
    ppl = {}
    bpt = []
    for ctx in args.contexts:
        row = {}
        for text in args.texts:
            ids = tokens[text][args.offset: args.offset + ctx]
            if len(ids) < ctx:
                log(f"  {text}: only {len(ids)} tokens after offset {args.offset}; skipped at {ctx}")
                continue
            kvq.set_backend(backend)
            kvq.prepare(model, ids)
            row[text] = perplexity(model, ids, device)
            bpt.append(backend.bytes_per_token(d))
        if row:
            row["mean"] = sum(row.values()) / len(row)
        ppl[str(ctx)] = row
        log(f"  {name} ctx {ctx}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    res["perplexity"] = ppl
    res["bytes_per_token_per_kv_head"] = (sum(bpt) / len(bpt)) if bpt else backend.bytes_per_token(d)
    res["bytes_fraction_of_fp16"] = res["bytes_per_token_per_kv_head"] / (4.0 * d)
    if hasattr(backend, "bytes_per_token_at"):  # fp16 sinks / recent window amortised over a context
        res["bytes_per_token_per_kv_head_at"] = {str(c): backend.bytes_per_token_at(d, c) for c in sorted(set(args.contexts) | {2048, 8192})}

    # Per-layer attention-output error against fp16 on identical inputs
    if name != "fp16" and args.layer_error_contexts:
        le = {}
        for ctx in args.layer_error_contexts:
            text = args.texts[0]
            ids = tokens[text][args.offset: args.offset + ctx]
            cmp = kvq.CompareBackend(kvq.Fp16Backend(), kvq.make_backend(name, max_tokens=ctx + 64))
            kvq.set_backend(cmp)
            kvq.prepare(model, ids)
            perplexity(model, ids, device)
            le[str(ctx)] = {"text": text, "rel_err_per_layer": [cmp.err[i] for i in sorted(cmp.err)],
                            "rel_err_mean": sum(cmp.err.values()) / len(cmp.err), "rel_err_max": max(cmp.err.values())}
            log(f"  {name} layer error @ {ctx}: mean {le[str(ctx)]['rel_err_mean']:.4g} max {le[str(ctx)]['rel_err_max']:.4g}")
        res["layer_error"] = le

    # kvforge kernels against the pure-torch simulation of the same tier, on identical inputs
    if name.startswith("kvforge:") and args.layer_error_contexts and not args.no_cross_check:
        spec, _, tier = name.partition(":")[2].rpartition(":")
        try:
            sim = kvq.SimBackend(spec, tier, f"sim:{spec}:{tier}")
        except SystemExit as e:
            sim = None
            log(f"  {name}: no simulation to cross-check against ({e})")
        if sim is not None:
            ctx = args.layer_error_contexts[0]
            ids = tokens[args.texts[0]][args.offset: args.offset + ctx]
            cmp = kvq.CompareBackend(sim, kvq.make_backend(name, max_tokens=ctx + 64))
            kvq.set_backend(cmp)
            perplexity(model, ids, device)
            res["vs_sim"] = {"context": ctx, "text": args.texts[0], "rel_err_per_layer": [cmp.err[i] for i in sorted(cmp.err)],
                             "rel_err_max": max(cmp.err.values()),
                             "what": "||o_kvforge - o_sim|| / ||o_sim|| per layer, same inputs (sim outputs fed forward)"}
            log(f"  {name} vs sim @ {ctx}: max rel err {res['vs_sim']['rel_err_max']:.3g}")

    # Needle in a haystack
    if args.needle_contexts:
        nd = {}
        hits = total = 0
        for ctx in args.needle_contexts:
            rows = []
            for depth in args.needle_depths:
                rng = random.Random(f"{ctx}-{depth}-{args.seed}")
                code = rng.randint(1000, 9999)
                ids, pos = needle_prompt(tok, hay_ids, ctx, depth, code)
                kvq.set_backend(backend)
                kvq.prepare(model, ids)
                out = needle_trial(model, tok, ids, device)
                hit = str(code) in re.findall(r"\d+", out)
                rows.append({"depth": depth, "code": code, "prompt_tokens": len(ids), "needle_token": pos,
                             "output": out, "hit": hit})
                hits += hit
                total += 1
            nd[str(ctx)] = {"trials": rows, "score": sum(r["hit"] for r in rows) / len(rows)}
            log(f"  {name} needle @ {ctx}: {nd[str(ctx)]['score']:.2f} " + "".join("x" if r["hit"] else "." for r in rows))
        res["needle"] = {"by_context": nd, "score": hits / total if total else None,
                         "text": args.needle_text, "needle": NEEDLE, "question": QUESTION}
    res["seconds"] = time.time() - t0
    return res


def parse_list(s: str, conv=str):
    return [conv(x) for x in s.split(",") if x.strip()] if s else []


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"path of {kvq.GGUF_NAME} or its folder (default: data/model, /root/m)")
    ap.add_argument("--data", type=Path, default=kvq.DATA, help="folder with austen/*.txt (default data/)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fp16 (default on cuda) | fp32 (default on cpu) | bf16")
    ap.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                    help="comma list; 'kvforge-all' expands to every shipped kvforge tier, "
                         + ", ".join(f"'{g}' to {' '.join(v)}" for g, v in SCHEME_GROUPS.items()))
    ap.add_argument("--texts", default=",".join(EVAL_TEXTS))
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--offset", type=int, default=0, help="first token of each window (0: start of the novel)")
    ap.add_argument("--layer-error-contexts", default="2048", help="contexts for per-layer error (first text); '' skips")
    ap.add_argument("--needle-contexts", default="1024,2048,4096", help="'0' or '' skips the needle test")
    ap.add_argument("--needle-depths", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--needle-text", default="northangerabbey")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cross-check", action="store_true", help="skip kvforge-vs-simulation per-layer comparison")
    ap.add_argument("--baseline-check", action="store_true",
                    help="also measure fp16 perplexity on the start of Pride and Prejudice at 512/2048/8192")
    ap.add_argument("--out", type=Path, help="JSON path (default benches/results/quality-<device>-<date>.json)")
    ap.add_argument("--png", action="store_true", help="also draw the frontier next to the JSON (plot.py)")
    args = ap.parse_args()

    calib = kvq.CALIBRATION_BOOK
    args.texts = parse_list(args.texts)
    if calib in args.texts or args.needle_text == calib:
        raise SystemExit(f"{calib} calibrates the codebooks (capture_keys.py); it is not an evaluation text")
    args.contexts = parse_list(args.contexts, int)
    args.layer_error_contexts = parse_list(args.layer_error_contexts, int)
    args.needle_contexts = [c for c in parse_list(args.needle_contexts, int) if c > 0]
    args.needle_depths = parse_list(args.needle_depths, float)
    schemes = []
    for s in parse_list(args.schemes):
        schemes += KVFORGE_SCHEMES if s == "kvforge-all" else SCHEME_GROUPS.get(s, [s])
    dtype = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("fp16" if args.device.startswith("cuda") else "fp32")]
    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))

    gguf = kvq.find_gguf(args.model)
    t0 = time.time()
    model, tok = kvq.load_model(gguf, args.device, dtype)
    log(f"loaded {gguf} on {args.device} as {dtype} in {time.time() - t0:.1f}s")
    d = model.config.head_dim
    needed = sorted(set(args.texts + [args.needle_text] + (["prideprejudice"] if args.baseline_check else [])))
    tokens = {t: kvq.book_tokens(tok, t, args.data) for t in needed}
    hay_ids = tokens[args.needle_text]

    if args.device.startswith("cuda"):
        dev_name = torch.cuda.get_device_name()
        slug = re.sub(r"[^a-z0-9]+", "-", dev_name.lower().replace("nvidia", "")).strip("-").split("-")[0]
    else:
        dev_name, slug = platform.processor() or platform.machine(), "cpu"
    date = dt.date.today().isoformat()
    out = args.out or (kvq.ROOT / "benches" / "results" / f"quality-{slug}-{date}.json")

    import transformers
    result = {
        "meta": {
            "what": "KV-cache scheme quality on SmolLM2-135M-Instruct (GGUF Q4_1); every number below measured by this run",
            "date": date, "device": dev_name, "torch": torch.__version__, "transformers": transformers.__version__,
            "model": str(gguf.name), "model_sha256": sha256_file(gguf), "dtype": str(dtype).replace("torch.", ""),
            "config": {"layers": model.config.num_hidden_layers, "q_heads": model.config.num_attention_heads,
                       "kv_heads": model.config.num_key_value_heads, "head_dim": d},
            "text_preparation": "data/austen/<book>.txt = R character vector lines joined with '\\n' (prepare.py); "
                                "tokenized whole, add_special_tokens=False (no BOS); a window is tokens "
                                f"[offset, offset+ctx) with offset {args.offset}; ppl = exp(mean NLL of tokens 1..ctx-1)",
            "calibration_text_excluded": calib,
            "argv": sys.argv[1:],
        },
        "schemes": {},
    }
    if args.baseline_check:
        fp = kvq.Fp16Backend()
        rows = {}
        for n in (512, 2048, 8192):
            if n > max(args.contexts + [512]) and args.device == "cpu":
                continue
            kvq.set_backend(fp)
            rows[str(n)] = perplexity(model, tokens["prideprejudice"][:n], args.device)
            log(f"baseline check: prideprejudice @ {n}: {rows[str(n)]:.4f}")
        result["baseline_check"] = {"text": "prideprejudice", "backend": "fp16", "perplexity": rows}

    for name in schemes:
        log(f"scheme {name}")
        try:
            result["schemes"][name] = run_scheme(name, model, tok, args, tokens, hay_ids, args.device, d)
        except SystemExit as e:  # e.g. kvforge not importable: record and go on
            log(f"  {name}: skipped: {e}")
            result["schemes"][name] = {"scheme": name, "skipped": str(e)}
        sync(args.device)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))  # after every scheme: partial results survive a timeout
    log(f"wrote {out}")
    if args.png:
        import plot
        plot.plot([out], out.with_suffix(".png"))


if __name__ == "__main__":
    main()
