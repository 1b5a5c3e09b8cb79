#!/usr/bin/env python3
"""Quick screen of K/V coding variants without re-running the model per variant: captures one
window's post-RoPE q/k/v of every layer (fp16 backend, one forward), then for each variant
reports the attention-output error of the last ``--queries`` queries over the whole window
with only K coded, only V coded, and both, plus the relative K and V errors (means over layers).

    .venv-torch/bin/python benches/quality/kv_screen.py --text persuasion --ctx 2048 \\
        --variants int4,fp8,r4,r3,r3-kc-sink64          # tier names of sim-tiers.toml or int8/int4/int2

A proxy for perplexity (it ignores error propagation through layers); on SmolLM2 at 2K the
perplexity ratio grows roughly with the square of this error (README, rotated tiers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402


def capture(text: str, ctx: int, model_path=None) -> dict:
    model, tok = kvq.load_model(kvq.find_gguf(model_path), "cpu", torch.float32)
    ids = kvq.book_tokens(tok, text)[:ctx]
    store = {}

    class Capture(kvq.Fp16Backend):
        def attend(self, layer, q, k, v, scaling):
            store[layer] = (q.clone(), k.clone(), v.clone(), scaling)
            return super().attend(layer, q, k, v, scaling)

    kvq.set_backend(Capture())
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    return store


def coder(name: str):
    """(keys, values) functions on [H, T, D] f32 (T a multiple of the page), as SimBackend
    codes full pages (sink tokens kept at the tail's precision)."""
    spec, tier = kvq.SIM_ALIASES.get(name, (None, None))
    if spec is None:
        spec, _, tier = name.rpartition(":")
    sim = kvq.TierSim(kvq.ROOT / spec, tier)

    def wrap(f):
        def g(x):
            if sim.sink:
                return torch.cat([sim.tail(x[:, :sim.sink]), f(x[:, sim.sink:])], dim=1)
            return f(x)
        return g
    return wrap(lambda k: sim.keys(k)), wrap(sim.values)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default="persuasion")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--variants", default="int4,fp8,r4,r3,r2")
    ap.add_argument("--model")
    ap.add_argument("--cache", type=Path, help="save / reuse the captured q/k/v here (.pt)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cache and args.cache.exists():
        store = torch.load(args.cache)
    else:
        store = capture(args.text, args.ctx, args.model)
        if args.cache:
            torch.save(store, args.cache)
    print(f"{'variant':18s} {'K only':>8s} {'V only':>8s} {'both':>8s} {'K err':>8s} {'V err':>8s}")
    for name in args.variants.split(","):
        fk, fv = coder(name)
        acc = torch.zeros(5, dtype=torch.float64)
        for _, (q, k, v, sc) in sorted(store.items()):
            q = q[:, -args.queries:]
            ref = kvq.eager_causal(q, k, v, sc)
            kq, vq = fk(k), fv(v)
            rel = lambda a, b: ((a - b).norm() / b.norm()).item()
            acc += torch.tensor([rel(kvq.eager_causal(q, kq, v, sc), ref), rel(kvq.eager_causal(q, k, vq, sc), ref),
                                 rel(kvq.eager_causal(q, kq, vq, sc), ref), rel(kq, k), rel(vq, v)], dtype=torch.float64)
        m = (acc / len(store)).tolist()
        print(f"{name:18s} " + " ".join(f"{x:8.4f}" for x in m), flush=True)


if __name__ == "__main__":
    main()
