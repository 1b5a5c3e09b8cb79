#!/usr/bin/env python3
"""Fisher-weighted distortion for kvtc: per-feature weights of SmolLM2's keys and values from the
diagonal Fisher information of the LM loss (as KVQuant weighs its KV quantisation error).

    python benches/quality/kvtc_fisher.py --device cpu --windows 6     # ~1 min per window on 2 cores
    python benches/quality/kvtc_fisher.py --device cuda --windows 16   # on the device

For every window of ``--tokens`` tokens of the calibration text (Emma, ``kvq.CALIBRATION_BOOK``;
never an evaluation text) it runs the model, takes the mean next-token NLL (the loss eval.py's
perplexity is the exponential of) and its gradient with respect to every layer's keys and values,
and accumulates the squared gradient per (layer, kv head, channel), averaged over the tokens kvtc
codes (the first ``--sinks`` and the last ``--window`` tokens of each window are kept in fp16 by
the codec and left out). ``F_f = E[(∂L/∂x_f)²]`` approximates the Hessian's diagonal, so an
error ``Δ`` raises the loss by about ``½ Σ_f F_f Δ_f²``: the weighted squared error that
``kvforge calibrate --weights`` minimises.

Keys: kvtc's PCA runs on *de-RoPEd* keys, so the weights must be per pre-RoPE channel. The
gradient is taken at the output of ``k_proj`` (before the rotary embedding), which is exactly the
de-RoPEd key: ``k_post = R_t k_pre``, so ``∂L/∂k_pre = R_tᵀ ∂L/∂k_post`` and its squared channels
are the Fisher diagonal in the domain the PCA and the step quantiser see. (Averaging the two
channels of a post-RoPE pair would be rotation-invariant too, but loses which channel of a
low-frequency pair the loss reads.) Values have no RoPE: the gradient at ``v_proj``'s output.

Output (default ``data/keys/kv-emma-fisher.safetensors``): ``k.weight`` / ``v.weight`` of shape
[layers, kv_heads, head_dim] (F32), the layout `kvforge calibrate --weights` reads; the metadata
holds the absolute mean of each side (``k.mean``, ``v.mean``): calibrate normalises each side by
its own mean, so the split of the budget between keys and values (``--key-share``) is where the
Fisher's absolute scale enters. ``--predict <calibrate log>`` (no model run) reads the expected
errors a Fisher-weighted `calibrate` grid printed and the means from ``--out``, and prints the
predicted increase of the mean NLL per key share and ratio,
``½ · N · T · (mean F_K · err_K + mean F_V · err_V)`` (``err`` per token; ``T`` coded tokens of a
window; ``N`` its tokens: the gradient is of the *mean* NLL, so a token's Fisher of the summed
loss is ``N²`` times it, and the mean divides the sum's increase by ``N``); the share with the
least is where the two sides' slopes meet.

``--mix <weights.safetensors>`` additionally writes the per-side geometric mean of the Fisher and
the given weights (each normalised to mean 1 first) and the two "one side Fisher" files, all
beside ``--out`` with suffixes ``-geo``, ``-kfisher`` (Fisher keys, given values) and
``-vfisher`` (given keys, Fisher values).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
from kvq import log  # noqa: E402


class SdpaBackend(kvq.Fp16Backend):
    """Exact causal attention through SDPA: differentiable like the eager one, without keeping
    every layer's [heads, S, S] probabilities for the backward (2048² × 9 heads × 30 layers)."""

    name = "sdpa"

    def attend(self, layer, q, k, v, scaling):
        g = q.shape[0] // k.shape[0]
        ks, vs = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
        o = F.scaled_dot_product_attention(q[None], ks[None], vs[None], is_causal=True, scale=scaling)[0]
        return o.transpose(0, 1).contiguous()


class GradTap:
    """Forward hooks on every layer's ``k_proj`` / ``v_proj`` that make their outputs leaves
    requiring grad, so one backward of the loss fills ``.grad`` of each (no parameter grads)."""

    def __init__(self, model):
        self.out = {}
        self.handles = []
        for i, lyr in enumerate(model.model.layers):
            for side, mod in (("k", lyr.self_attn.k_proj), ("v", lyr.self_attn.v_proj)):
                self.handles.append(mod.register_forward_hook(self._hook(side, i)))

    def _hook(self, side, layer):
        def hook(_mod, _inp, out):
            leaf = out.detach().requires_grad_(True)
            self.out[(side, layer)] = leaf
            return leaf
        return hook


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--data", type=Path, default=kvq.DATA)
    ap.add_argument("--text", default=kvq.CALIBRATION_BOOK)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per window (the evaluation's context)")
    ap.add_argument("--windows", type=int, default=6, help="consecutive windows of --tokens from --offset")
    ap.add_argument("--offset", type=int, default=0, help="first token of the first window")
    ap.add_argument("--sinks", type=int, default=4, help="leading tokens per window kvtc keeps in fp16 (left out)")
    ap.add_argument("--window", type=int, default=128, help="trailing tokens per window kvtc keeps in fp16 (left out)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fp32 (default: the backward in fp16 underflows) | bf16")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--out", type=Path, default=kvq.DATA / "keys" / "kv-emma-fisher.safetensors")
    ap.add_argument("--mix", type=Path, help="weights file (capture_keys.py's) to mix with: also writes -geo, -kfisher, -vfisher")
    ap.add_argument("--predict", type=Path, help="a `kvforge calibrate` log of a grid with the --out weights: print the predicted loss per share and exit")
    args = ap.parse_args()
    from safetensors.torch import load_file, save_file

    if args.predict:
        predict(args.predict, args.out)
        return

    if args.text != kvq.CALIBRATION_BOOK:
        log(f"warning: Fisher on {args.text}, not the calibration text {kvq.CALIBRATION_BOOK}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or "fp32"]
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    gguf = kvq.find_gguf(args.model)
    model, tok = kvq.load_model(gguf, args.device, dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = model.config
    layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    ids = kvq.book_tokens(tok, args.text, args.data)
    need = args.offset + args.windows * args.tokens
    if len(ids) < need:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, need {need}")
    kvq.set_backend(SdpaBackend())
    tap = GradTap(model)
    lo, hi = args.sinks, args.tokens - args.window
    acc = {s: torch.zeros(layers, hkv, d, dtype=torch.float64) for s in "kv"}
    halves = [{s: torch.zeros(layers, hkv, d, dtype=torch.float64) for s in "kv"} for _ in range(2)]
    n = 0
    for w in range(args.windows):
        t0 = time.time()
        a = args.offset + w * args.tokens
        x = torch.tensor([ids[a:a + args.tokens]], device=args.device)
        logits = model(input_ids=x, use_cache=False).logits.float()
        loss = F.cross_entropy(logits[0, :-1], x[0, 1:])
        loss.backward()
        for (side, layer), leaf in tap.out.items():
            g = leaf.grad[0, lo:hi].double().reshape(hi - lo, hkv, d).pow(2).sum(0).cpu()
            acc[side][layer] += g
            halves[w * 2 // args.windows][side][layer] += g
        n += hi - lo
        tap.out.clear()
        log(f"window {w + 1}/{args.windows}: loss {loss.item():.4f} (ppl {loss.exp().item():.2f}) in {time.time() - t0:.1f}s")
    fisher = {s: (acc[s] / n).float() for s in "kv"}
    if args.windows >= 2:
        for s in "kv":
            a, b = (h[s].flatten().clamp_min(1e-30).log() for h in halves)
            log(f"{s}: log-Fisher correlation between the two halves of the windows {torch.corrcoef(torch.stack([a, b]))[0, 1]:.3f}")
    for s in "kv":
        f = fisher[s]
        per_layer = f.sum(dim=(1, 2))
        log(f"{s}: mean {f.mean():.3e}; max/mean {f.max() / f.mean():.1f}; per-layer share of the mass, first/last 5: "
            f"{[round(float(x), 3) for x in per_layer[:5] / per_layer.sum()]} / {[round(float(x), 3) for x in per_layer[-5:] / per_layer.sum()]}")
    meta = {"text": args.text, "tokens": str(args.tokens), "windows": str(args.windows), "offset": str(args.offset), "sinks": str(args.sinks),
            "window": str(args.window), "positions_averaged": str(n), "model": gguf.name, "dtype_of_run": str(dtype), "layers": str(layers),
            "kv_heads": str(hkv), "head_dim": str(d), "k.mean": repr(float(fisher["k"].mean())), "v.mean": repr(float(fisher["v"].mean())),
            "what": "diagonal Fisher of the mean next-token NLL: E[(dL/dx_f)^2] over the coded tokens; keys pre-RoPE (k_proj output), values v_proj output"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"k.weight": fisher["k"].contiguous(), "v.weight": fisher["v"].contiguous()}, str(args.out), metadata=meta)
    log(f"wrote {args.out}")
    if args.mix:
        given = load_file(str(args.mix))
        norm = {s: fisher[s] / fisher[s].mean() for s in "kv"}
        gnorm = {s: given[f"{s}.weight"].float() / given[f"{s}.weight"].float().mean() for s in "kv"}
        variants = {
            "geo": {s: (norm[s] * gnorm[s]).sqrt() for s in "kv"},
            "kfisher": {"k": norm["k"], "v": gnorm["v"]},
            "vfisher": {"k": gnorm["k"], "v": norm["v"]},
        }
        for name, ws in variants.items():
            path = args.out.with_name(f"{args.out.stem}-{name}{args.out.suffix}")
            save_file({f"{s}.weight": ws[s].contiguous() for s in "kv"}, str(path),
                      metadata={**meta, "what": f"{name}: mix of the Fisher and {args.mix.name} (each side normalised to mean 1)"})
            log(f"wrote {path}")


def predict(log_path: Path, weights: Path):
    """Prints ``½ · N · T · (mean F_K · err_K + mean F_V · err_V)`` per key share and ratio of a
    calibrate log (its expected errors are in units of each side's mean weight)."""
    import re

    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        meta = f.metadata()
    mean = {"keys": float(meta["k.mean"]), "values": float(meta["v.mean"])}
    n = int(meta["tokens"]) * (int(meta["tokens"]) - int(meta["sinks"]) - int(meta["window"]))
    share, pred = None, {}
    for line in log_path.read_text().splitlines():
        if m := re.search(r"key share ([0-9.]+)", line):
            share = m[1]
        elif m := re.search(r"([0-9.]+)x (keys|values)\s*:.*expected error ([0-9.eE+-]+)", line):
            pred.setdefault((m[1], share), {})[m[2]] = float(m[3])
    for (ratio, sh), e in sorted(pred.items(), key=lambda x: (float(x[0][0]), float(x[0][1]))):
        k, v = (0.5 * n * mean[s] * e[s] for s in ("keys", "values"))
        print(f"{ratio}x key share {sh}: predicted loss increase {k + v:.5f} (keys {k:.5f}, values {v:.5f}) -> perplexity ratio ~{math.exp(k + v):.4f}")


if __name__ == "__main__":
    main()
