"""kvforge.hf on SmolLM2-135M (issue 29's `kvforge.hf` targets): prefill seconds and decode
ms/token of ``model.generate`` with transformers' eager and sdpa attention and with
``kvforge.hf.use_kvforge`` on each tier, batch 1 (one prompt) and batch B (prompts of different
lengths, left padded), and greedy token agreement: every backend against eager, and each
kvforge batch row against the same prompt generated alone.

Backends ``kvgen:<tier>`` and ``kvgraph:<tier>`` time ``kvforge.hf.generate`` (no transformers KV
cache; ``kvgraph`` replays each decode step from a CUDA graph, captures included in the time)
instead of ``model.generate``.

Timing: prefill = ``generate(max_new_tokens=1)`` (the prompt's forward and one token); decode
ms/token = (``generate(max_new_tokens=N + 1)`` - prefill) / N, ``min_new_tokens`` = max so no
row stops early; median of ``--reps`` after one warm-up (kernel compiles, allocator).

    python3 benches/serve/hf_bench.py --model-dir /root/m --out hf.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches" / "quality"))

TIERS = {"fp16": ("specs/baseline.toml", "fp16"), "b8": ("specs/rdkv.toml", "b8"), "b4": ("specs/rdkv.toml", "b4"),
         "r3": ("specs/rotated.toml", "r3")}


def prompts_of(tok, lengths, text_dir: Path, vocab: int):
    """Token-id prompts of the given lengths: consecutive windows of an Austen novel where the
    texts are there, else seeded random ids."""
    import torch

    texts = sorted(text_dir.glob("*.txt")) if text_dir.is_dir() else []
    if texts:
        ids = tok(texts[0].read_text(encoding="utf-8", errors="replace")[:120_000], add_special_tokens=False)["input_ids"]
        out, at = [], 0
        for n in lengths:
            out.append(torch.tensor(ids[at:at + n]))
            at += n
        return out, texts[0].name
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 100, (n,), generator=g) for n in lengths], "random ids"


def left_pad(prompts, pad: int, device):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _sync(t):
    import torch

    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def generate(model, ids, mask, n: int, mode=None):
    """``model.generate`` (mode None), or ``kvforge.hf.generate`` without (``"plain"``) or with
    (``"graph"``) a CUDA graph: (new tokens [B, n], seconds)."""
    _sync(ids)
    t0 = time.perf_counter()
    if mode is None:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=model.config.pad_token_id or 0)[:, ids.shape[1]:]
    else:
        import kvforge.hf

        out = kvforge.hf.generate(model, ids, mask, max_new_tokens=n, cuda_graph=mode == "graph")
    _sync(ids)
    return out, time.perf_counter() - t0


def timed(model, ids, mask, new: int, reps: int, mode=None):
    """(tokens [B, new], prefill s, decode ms/token): medians over reps after a warm-up."""
    generate(model, ids, mask, new + 1, mode)  # warm-up: compiles, allocations
    pre, full, toks = [], [], None
    for _ in range(reps):
        pre.append(generate(model, ids, mask, 1, mode)[1])
        toks, t = generate(model, ids, mask, new + 1, mode)
        full.append(t)
    p, f = statistics.median(pre), statistics.median(full)
    return toks[:, :new], p, (f - p) / new * 1e3


def agreement(a, b) -> dict:
    """Position-wise equal tokens and the first position that differs (None: all equal)."""
    a, b = a.tolist(), b.tolist()
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"equal": same, "of": len(a), "first_diff": first}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/root/m")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--batch-lens", default="2048,1536,1024,517", help="prompt lengths of the batch run (left padded)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--backends", default="eager,sdpa,kvforge:fp16,kvforge:b8,kvforge:b4,kvforge:r3",
                    help="eager, sdpa, kvforge:<tier> (model.generate), kvgen:<tier> (kvforge.hf.generate), "
                         "kvgraph:<tier> (kvforge.hf.generate with a CUDA graph); tiers: " + ", ".join(TIERS))
    ap.add_argument("--alone", default="kvforge:b4", help="backends whose batch rows are also generated one by one")
    ap.add_argument("--out", default="hf-bench.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of eager/sdpa (kvforge needs a GPU)")
    args = ap.parse_args(argv)

    import torch
    import kvq
    import kvforge
    import kvforge.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = kvq.find_gguf(args.model_dir)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    dev = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float16 if dev.type == "cuda" else torch.float32,
                                                 attn_implementation="eager").to(dev).eval()
    one, src = prompts_of(tok, [args.prompt_len], ROOT / "data" / "austen", model.config.vocab_size)
    lens = [int(x) for x in args.batch_lens.split(",")]
    many, _ = prompts_of(tok, lens, ROOT / "data" / "austen", model.config.vocab_size)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    runs = {"1": left_pad(one, pad, dev), str(len(lens)): left_pad(many, pad, dev)}
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "kvforge": kvforge.__version__,
           "transformers": __import__("transformers").__version__, "model": gguf.name, "prompt_source": src,
           "prompt_len": args.prompt_len, "batch_lens": lens, "new_tokens": args.new, "reps": args.reps, "rows": []}
    ref = {}
    t_start = time.time()
    for name in args.backends.split(","):
        handle, mode = None, {"kvgen": "plain", "kvgraph": "graph"}.get(name.split(":", 1)[0])
        if name in ("eager", "sdpa"):
            model.config._attn_implementation = name
        else:
            spec, tier = TIERS[name.split(":", 1)[1]]
            handle = kvforge.hf.use_kvforge(model, spec=spec, tier=tier, root=str(ROOT))
        try:
            for b, (ids, mask) in runs.items():
                toks, pre, dec = timed(model, ids, mask, args.new, args.reps, mode)
                row = {"backend": name, "batch": int(b), "prefill_s": pre, "decode_ms_per_token": dec}
                if name == "eager":
                    ref[b] = toks
                if b in ref:
                    row["vs_eager"] = [agreement(toks[i], ref[b][i]) for i in range(toks.shape[0])]
                if int(b) > 1 and name in args.alone.split(","):
                    alone = []
                    for i, p in enumerate(many):
                        t1, _ = generate(model, *left_pad([p], pad, dev), args.new, mode)
                        alone.append(agreement(toks[i], t1[0]))
                    row["batch_vs_alone"] = alone
                if handle is not None:
                    row["bytes_per_token"] = handle.bytes_per_token()
                res["rows"].append(row)
                eq = ""
                if "vs_eager" in row:
                    eq = " vs eager " + " ".join(f"{a['equal']}/{a['of']}" for a in row["vs_eager"])
                if "batch_vs_alone" in row:
                    eq += " | batch vs alone " + " ".join(f"{a['equal']}/{a['of']}" for a in row["batch_vs_alone"])
                print(f"{name:14s} batch {b}: prefill {pre:.4f} s  decode {dec:6.2f} ms/token{eq}  ({time.time() - t_start:.0f} s)",
                      flush=True)
                Path(args.out).write_text(json.dumps(res, indent=1))
        finally:
            if handle is not None:
                handle.detach()
            model.config._attn_implementation = "eager"
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
