#!/usr/bin/env python3
"""SmolLM2-135M-Instruct (GGUF) on kvforge attention: perplexity on the first 512 tokens of
Pride and Prejudice with transformers' fp16 eager attention and with a kvforge tier, then a
short greedy generation with each.

    export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVFORGE_ROOT=$PWD KVFORGE_CACHE_DIR=/tmp/kvc
    PYTHONPATH=/tmp/site:$PWD/.whl-py python3 crates/kvforge-py/examples/smollm2.py /root/m --tier b4

The model folder holds SmolLM2-135M-Instruct.Q4_1.gguf (benches/quality/prepare.py fetches it;
the ``gguf`` package must be importable). The text is prepared as benches/quality does
(``kvq.book_tokens``: the novel's lines joined with newlines, no BOS); the issue's fp16
baseline for this window is 16.14.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvforge.hf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benches" / "quality"))
import kvq  # noqa: E402  (text preparation of the quality benchmark)

QUESTION = "What is the capital of France? Answer in one sentence."


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    return math.exp(model(input_ids=ids, labels=ids, use_cache=False).loss.float().item())


@torch.no_grad()
def greedy(model, tok, prompt: torch.Tensor, new: int) -> str:
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                         do_sample=False, pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 2)
    return tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help=f"folder holding {kvq.GGUF_NAME} (or the .gguf file)")
    ap.add_argument("--spec", default="specs/rdkv.toml", help="kvforge spec (relative: under KVFORGE_ROOT / the repo)")
    ap.add_argument("--tier", default="b4", help="tier full pages are stored in (rdkv: b8, b4, b2)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--text", default="prideprejudice")
    ap.add_argument("--data", type=Path, default=kvq.DATA, help="folder with austen/<text>.txt")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "fp32"], help="fp32: CPU checks only")
    args = ap.parse_args(argv)

    gguf = kvq.find_gguf(args.model)
    dtype = torch.float16 if args.dtype == "fp16" else torch.float32
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                                 attn_implementation="eager").to(args.device).eval()
    print(f"loaded {gguf.name} ({dtype}) on {args.device} in {time.time() - t0:.1f}s; kvforge {kvforge.__version__}")
    ids = torch.tensor([kvq.book_tokens(tok, args.text, args.data)[: args.tokens]], device=args.device)
    chat = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    prompt = torch.tensor([chat], device=args.device)

    rows = []
    t0 = time.time()
    ppl = perplexity(model, ids)
    rows.append(("fp16 eager" if dtype == torch.float16 else "fp32 eager", ppl, 4.0 * model.config.head_dim,
                 greedy(model, tok, prompt, args.new_tokens), time.time() - t0))

    t0 = time.time()
    # prefill="cache": the window's own queries attend the compressed cache, so its perplexity
    # measures the tier (the default, "sdpa", attends a prompt exactly as a serving prefill).
    kv = kvforge.hf.use_kvforge(model, spec=args.spec, tier=args.tier, root=str(ROOT), prefill="cache")
    ppl = perplexity(model, ids)
    bpt = kv.bytes_per_token()  # as held after the 512-token window
    rows.append((f"kvforge {args.spec}:{args.tier}", ppl, bpt, greedy(model, tok, prompt, args.new_tokens),
                 time.time() - t0))

    print(f"\nperplexity @ {ids.shape[1]} tokens of {args.text} (issue's fp16 baseline @ 512: 16.14)")
    for name, ppl, bpt, _, sec in rows:
        print(f"  {name:32s} ppl {ppl:8.4f}   {bpt:6.1f} B/token/kv head   {sec:5.1f}s")
    print(f"\ngreedy, {args.new_tokens} tokens: {QUESTION}")
    for name, _, _, text, _ in rows:
        print(f"  {name:32s} {text!r}")
    kv.detach()
    return rows


if __name__ == "__main__":
    main()
