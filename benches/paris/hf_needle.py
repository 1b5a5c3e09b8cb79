#!/usr/bin/env python3
"""SmolLM2-135M decoding with ParisKV retrieval on the real kernels (``kvforge.retrieval``):
needle retrieval at 4K / 8K and greedy agreement with fp16 eager attention.

The prompt is attended exactly (SDPA); every generated token's attention runs on sinks +
local window + the top-k keys the GPU retrieves from the rest (``kvforge.ParisIndex``). The
perplexity of the same pipeline is measured by its bit-exact torch port
(``eval.py --schemes sim:paris-k256``, ``benches/results/quality-paris-*.json``); this script
checks the kernels themselves on the model.

    python3 benches/paris/hf_needle.py --model /root/m --out $OUT/paris-hf-needle.json
    python3 benches/paris/hf_needle.py --model /root/m --per-kv-head --rank max --out $OUT/paris-hf-needle-hmax.json

``--spec`` / ``--tier`` keep the sinks and the local window in a kvforge cache coded in that tier
(``kvforge.RetrievalCache``) instead of fp16 rows in the index:

    python3 benches/paris/hf_needle.py --model /root/m --per-kv-head --spec specs/rotated.toml --tier r3 --out $OUT/paris-hf-needle-r3.json

``--per-kv-head`` runs one retrieval per kv head (the fast mode); ``--rank`` orders its candidates:
``max`` (default, "hmax": the largest of the group's head estimates) or ``sum`` (the summed
query's estimate).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches" / "quality"))
import eval as ev  # noqa: E402  (needle prompt and trial)
import kvq  # noqa: E402

import kvforge  # noqa: E402
import kvforge.retrieval  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or its folder (default data/model, /root/m)")
    ap.add_argument("--contexts", default="4096,8000")
    ap.add_argument("--depths", default="0.25,0.5,0.75")
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--local", type=int, default=256)
    ap.add_argument("--update", type=int, default=64)
    ap.add_argument("--per-kv-head", action="store_true", help="one retrieval per kv head (the summed group query's vote) instead of per query head")
    ap.add_argument("--rank", choices=["max", "sum"], default="max",
                    help="with --per-kv-head: rank the candidates by the largest head estimate (max, 'hmax') or the summed query's (sum)")
    ap.add_argument("--layout", choices=["whole64", "subspace4"], default="whole64",
                    help="GPU summaries: the 64 B whole-vector code (whole64, the default, its schedule) or the seed's 112 B per key (subspace4)")
    ap.add_argument("--spec", default=None, help="keep sinks and window in a kvforge cache of this spec (kvforge.RetrievalCache), with --tier")
    ap.add_argument("--tier", default=None, help="the tier of the window's coded pages (e.g. r3 of specs/rotated.toml)")
    ap.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens compared with eager on an 8K Austen prompt")
    ap.add_argument("--out", default="paris-hf-needle.json")
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = kvq.find_gguf(a.model)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float16, attn_implementation="eager").cuda().eval()
    hay = kvq.book_tokens(tok, "northangerabbey")
    doc = {"what": "SmolLM2-135M greedy decoding with ParisKV retrieval on the kvforge kernels (kvforge.retrieval) vs eager fp16",
           "device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "args": vars(a), "needle": {}, "agreement": {}}
    pad = tok.pad_token_id if tok.pad_token_id is not None else 2

    def run(label: str, attach):
        handle = attach()
        hits, answers = [], []
        for ctx in [int(x) for x in a.contexts.split(",") if x]:
            for depth in [float(x) for x in a.depths.split(",") if x]:
                code = 1000 + int(depth * 7919) % 9000
                ids, _ = ev.needle_prompt(tok, hay, ctx, depth, code)
                with torch.no_grad():
                    ans = ev.needle_trial(model, tok, ids, "cuda")
                hit = str(code) in re.findall(r"\d+", ans)
                hits.append(hit)
                answers.append({"context": ctx, "depth": depth, "code": code, "answer": ans.strip()[:40], "hit": hit})
                print(f"{label:>10} ctx {ctx:5d} depth {depth:.2f}: {'hit ' if hit else 'MISS'} {ans.strip()[:40]!r}", flush=True)
        x = torch.tensor([kvq.book_tokens(tok, "persuasion")[:8000]], device="cuda")
        with torch.no_grad():
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=a.agree_tokens, do_sample=False, pad_token_id=pad)
        stats = handle.stats() if handle is not None and hasattr(handle, "stats") else None
        if handle is not None:
            handle.detach()
        return hits, answers, gen[0, x.shape[1]:].tolist(), stats

    t0 = time.time()
    base_hits, base_answers, base_tokens, _ = run("eager", lambda: None)
    doc["needle"]["eager"] = {"hits": sum(base_hits), "trials": len(base_hits), "answers": base_answers}
    attach = lambda: kvforge.retrieval.use_retrieval(model, k=a.k, sinks=a.sinks, local=a.local, update=a.update,
                                                           per_query_head=not a.per_kv_head, rank=a.rank, layout=a.layout,
                                                           spec=a.spec, tier=a.tier, root=str(ROOT))  # noqa: E731
    label = f"paris-k{a.k}" + (f"-kv-{a.rank}" if a.per_kv_head else "") + ("-whole64" if a.layout == "whole64" else "") + (f"-cache-{a.tier}" if a.tier else "")
    hits, answers, tokens, stats = run(label, attach)
    same = next((i for i, (p, q) in enumerate(zip(base_tokens, tokens)) if p != q), len(tokens))
    doc["needle"][label] = {"hits": sum(hits), "trials": len(hits), "answers": answers, "stats": stats}
    doc["agreement"] = {"prompt": "persuasion, first 8000 tokens", "tokens": len(tokens), "identical_prefix": same,
                        "matching": sum(p == q for p, q in zip(base_tokens, tokens))}
    doc["seconds"] = time.time() - t0
    print(f"needle: eager {sum(base_hits)}/{len(base_hits)}, {label} {sum(hits)}/{len(hits)}; greedy agreement "
          f"{doc['agreement']['matching']}/{len(tokens)} (identical prefix {same}); stats {stats}", flush=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
