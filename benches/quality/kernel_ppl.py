#!/usr/bin/env python3
"""Teacher-forced perplexity of SmolLM2 decoded on the kvforge kernels (``kvforge.hf.score``):
the first ``--prefix`` tokens of each window are one prompt forward, every later token one
decode step whose query attends the cache as it stands at that token. A window policy
(``--sink-pages``, ``--recent-pages``) and the encoding of pages as they leave the window take
effect as in decoding, which the simulation (``eval.py --schemes sim:...-sink64-win128``) only
models. The reference is eager fp16 attention over the same tokens (one forward, the NLLs of
the same positions), so the ratio isolates the cache.

    python3 benches/quality/kernel_ppl.py --model /root/m --contexts 2048 \\
        --tiers specs/rotated.toml:r4,specs/rotated.toml:r3,specs/rotated.toml:r2 \\
        --sink-pages 1 --recent-pages 2 --out $OUT/quality-kernel-window.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import eval as ev  # noqa: E402  (the evaluation texts)
import kvq  # noqa: E402

import kvforge.hf  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def eager_nll(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """NLLs of tokens ``prefix .. n - 1`` of ``ids`` [1, n] from one eager forward."""
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return -torch.log_softmax(logits[:, prefix - 1:-1].float(), -1).gather(-1, ids[:, prefix:, None])[..., 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or its folder (default data/model, /root/m)")
    ap.add_argument("--texts", default=",".join(ev.EVAL_TEXTS))
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--prefix", type=int, default=64, help="tokens of the prompt forward; the rest are decode steps")
    ap.add_argument("--tiers", default="specs/baseline.toml:fp16,specs/rotated.toml:r4,specs/rotated.toml:r3,specs/rotated.toml:r2",
                    help="spec:tier list run through kvforge.hf.use_kvforge")
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--recent-pages", type=int, default=2)
    ap.add_argument("--no-graph", action="store_true", help="decode steps without the CUDA graph")
    ap.add_argument("--needle-contexts", default="", help="needle contexts (eval.py's prompt, depths 0.25/0.5/0.75): the "
                    "prompt attended exactly, the answer decoded on the cache")
    ap.add_argument("--out", default="quality-kernel.json")
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = kvq.find_gguf(a.model)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float16, attn_implementation="eager").cuda().eval()
    texts = [t for t in a.texts.split(",") if t]
    contexts = [int(c) for c in a.contexts.split(",") if c]
    tokens = {t: kvq.book_tokens(tok, t) for t in texts}
    doc = {"what": "teacher-forced perplexity on the kvforge kernels (kvforge.hf.score: a prompt forward of --prefix tokens, "
                   "then one decode step per token) against eager fp16 over the same positions; windows are tokens [0, ctx) of each "
                   "novel (tokenized whole, no BOS), as eval.py",
           "device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "args": vars(a), "eager": {}, "tiers": {}}
    t0 = time.time()
    ref = {}
    for ctx in contexts:
        for text in texts:
            ids = torch.tensor([tokens[text][:ctx]], device="cuda")
            nll = eager_nll(model, ids, a.prefix)
            ref[(ctx, text)] = nll
            doc["eager"].setdefault(str(ctx), {})[text] = math.exp(nll.mean().item())
        log(f"eager {ctx}: " + ", ".join(f"{t} {doc['eager'][str(ctx)][t]:.3f}" for t in texts))
    for spec_tier in [x for x in a.tiers.split(",") if x]:
        spec, tier = spec_tier.rsplit(":", 1)
        row = {"spec": spec, "tier": tier, "sink_pages": a.sink_pages, "recent_pages": a.recent_pages, "contexts": {}}
        for ctx in contexts:
            per_text = {}
            for text in texts:
                h = kvforge.hf.use_kvforge(model, spec=spec, tier=tier, root=str(ROOT.parents[1]), cuda_graph=not a.no_graph,
                                           sink_pages=a.sink_pages, recent_pages=a.recent_pages, max_tokens=max(contexts) + 256)
                ids = torch.tensor([tokens[text][:ctx]], device="cuda")
                t1 = time.time()
                nll = kvforge.hf.score(model, ids, prefix=a.prefix)
                torch.cuda.synchronize()
                secs = time.time() - t1
                bpt = kvforge.hf.bytes_per_token(model)
                h.detach()
                ppl, base = math.exp(nll.mean().item()), doc["eager"][str(ctx)][text]
                per_text[text] = {"ppl": ppl, "ratio": ppl / base, "seconds": secs, "bytes_per_token_per_kv_head": bpt}
                log(f"{spec_tier} {ctx} {text}: ppl {ppl:.4f} (eager {base:.4f}, ratio {ppl / base:.4f}) in {secs:.1f}s")
            mean_ppl = sum(v["ppl"] for v in per_text.values()) / len(per_text)
            mean_ref = sum(doc["eager"][str(ctx)][t] for t in per_text) / len(per_text)
            row["contexts"][str(ctx)] = {"texts": per_text, "ratio_of_means": mean_ppl / mean_ref,
                                         "mean_ratio": sum(v["ratio"] for v in per_text.values()) / len(per_text)}
            log(f"{spec_tier} {ctx}: ratio of mean perplexities {mean_ppl / mean_ref:.4f}")
        hay = kvq.book_tokens(tok, "northangerabbey")
        for ctx in [int(c) for c in a.needle_contexts.split(",") if c]:
            h = kvforge.hf.use_kvforge(model, spec=spec, tier=tier, root=str(ROOT.parents[1]), sink_pages=a.sink_pages,
                                       recent_pages=a.recent_pages, max_tokens=ctx + 256)
            trials = []
            for depth in (0.25, 0.5, 0.75):
                code = 1000 + int(depth * 7919) % 9000
                ids, _ = ev.needle_prompt(tok, hay, ctx, depth, code)
                ans = ev.needle_trial(model, tok, ids, "cuda")
                trials.append({"depth": depth, "code": code, "answer": ans.strip()[:40], "hit": str(code) in ans})
            h.detach()
            row.setdefault("needle", {})[str(ctx)] = {"hits": sum(t["hit"] for t in trials), "trials": trials}
            log(f"{spec_tier} needle {ctx}: {sum(t['hit'] for t in trials)}/3 {[t['answer'] for t in trials]}")
        doc["tiers"][spec_tier] = row
        Path(a.out).write_text(json.dumps(doc, indent=1))  # what finished, should the call end early
    doc["seconds"] = time.time() - t0
    Path(a.out).write_text(json.dumps(doc, indent=1))
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
