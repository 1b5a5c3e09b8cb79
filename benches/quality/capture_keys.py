#!/usr/bin/env python3
"""Capture real post-RoPE keys (and values) of SmolLM2 on the calibration text for
`kvforge codebook train` and the RDKV distortion tables.

    python benches/quality/capture_keys.py --device cpu --tokens 4096      # ~1-2 min on 2 cores
    python benches/quality/capture_keys.py --device cuda --tokens 8192     # on the device

The calibration text is Emma (``kvq.CALIBRATION_BOOK``), which eval.py refuses to evaluate on.
Outputs (default ``data/keys/``):

* ``keys-emma.safetensors``: one tensor ``keys`` of shape [layers*kv_heads*tokens, head_dim]
  (F16; row = (layer*kv_heads + head)*tokens + t), the format `kvforge codebook train
  --samples` reads (first tensor; rows split into groups of --group channels). Metadata says
  what it holds.
* ``values-emma.safetensors``: ``values``, same layout.
* ``kv-emma-per-layer.safetensors``: ``k.L00`` ... / ``v.L00`` ... of shape [kv_heads, tokens, head_dim],
  ``positions`` [tokens] (I64: each window starts at 0) and the model's RoPE in the metadata
  (``rope_theta``, ``rope_dim``): the K/V dump `kvforge calibrate` (kvtc) reads.
* ``kv-emma-weights.safetensors``: ``k.weight`` / ``v.weight`` of shape [layers, kv_heads, head_dim]
  (F32), what `kvforge calibrate --weights` scales features by (the square root of): for keys
  the mean query energy of each RoPE pair (``(q_j² + q_{j+rope_dim/2}²) / 2``, rotation-invariant,
  so pre- and post-RoPE agree; channels beyond rope_dim their own ``q_c²``) summed over the query
  heads that read the kv head (a key error ``Δk`` moves their logits by ``q·Δk``); for values the
  energy of the matching ``o_proj`` columns, summed over those query heads (an output error
  ``Σ p Δv`` reaches the residual stream through ``W_o``), divided by the mean energy of the
  residual stream entering the layer (sink tokens left out; the next RMSNorm sees the error
  relative to it).

Then, for the shipped spherical tiers (specs/spherical.toml: group 16 / 6 bits, 16 / 4, 32 / 3):

    cargo run --release -p kvforge -- codebook train --samples data/keys/keys-emma.safetensors \\
        --group 16 --angle-bits 6 --out codebooks/sph_g16_b6.safetensors
    (same with --group 16 --angle-bits 4 -> sph_g16_b4, --group 32 --angle-bits 3 -> sph_g32_b3)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
from kvq import log  # noqa: E402


class CaptureBackend(kvq.Fp16Backend):
    """Exact attention that keeps every layer's post-RoPE K and V ([Hkv, S, D])."""

    name = "capture"

    def __init__(self, rope_dim: int):
        self.k, self.v = {}, {}
        self.rope_dim = rope_dim
        self.qe, self.qn = {}, {}

    def reset(self):
        self.k, self.v = {}, {}

    def attend(self, layer, q, k, v, scaling):
        self.k[layer] = k.detach().to("cpu", torch.float16)
        self.v[layer] = v.detach().to("cpu", torch.float16)
        # query energy per channel, pairs averaged (RoPE rotates within a pair), summed over the
        # query heads of each kv head: [Hkv, D]
        e = q.detach().float().pow(2).sum(dim=1)  # [Hq, D]
        r = self.rope_dim // 2
        if r:
            pair = (e[:, :r] + e[:, r:2 * r]) / 2
            e = torch.cat([pair, pair, e[:, 2 * r:]], dim=1)
        e = e.reshape(k.shape[0], -1, e.shape[1]).sum(dim=1).cpu()
        self.qe[layer] = self.qe.get(layer, 0) + e
        self.qn[layer] = self.qn.get(layer, 0) + q.shape[1]
        return super().attend(layer, q, k, v, scaling)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--data", type=Path, default=kvq.DATA)
    ap.add_argument("--text", default=kvq.CALIBRATION_BOOK)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per window")
    ap.add_argument("--windows", type=int, default=1, help="consecutive windows of --tokens from the start")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fp16 (cuda default) | fp32 (cpu default)")
    ap.add_argument("--out-dir", type=Path, default=kvq.DATA / "keys")
    args = ap.parse_args()
    from safetensors.torch import save_file

    dtype = {"fp16": torch.float16, "fp32": torch.float32}[args.dtype or ("fp16" if args.device.startswith("cuda") else "fp32")]
    if args.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    gguf = kvq.find_gguf(args.model)
    model, tok = kvq.load_model(gguf, args.device, dtype)
    ids = kvq.book_tokens(tok, args.text, args.data)
    theta, rope_dim = kvq.rope_params(model)
    cap = CaptureBackend(rope_dim)
    ks, vs = {}, {}
    resid, resid_n = None, 0
    for w in range(args.windows):
        window = ids[w * args.tokens:(w + 1) * args.tokens]
        if len(window) < args.tokens:
            raise SystemExit(f"{args.text} has only {len(ids)} tokens")
        kvq.set_backend(cap)
        t0 = time.time()
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([window], device=args.device), use_cache=False, output_hidden_states=True).hidden_states
        # residual stream entering each layer, energy per token, the 4 sink tokens left out
        e = torch.stack([h[0, 4:].float().pow(2).sum(-1).sum() for h in hs[:-1]]).cpu()
        resid, resid_n = (e if resid is None else resid + e), resid_n + hs[0].shape[1] - 4
        log(f"window {w}: {args.tokens} tokens in {time.time() - t0:.1f}s")
        for layer in cap.k:
            ks.setdefault(layer, []).append(cap.k[layer])
            vs.setdefault(layer, []).append(cap.v[layer])
    layers = sorted(ks)
    K = {l: torch.cat(ks[l], dim=1) for l in layers}  # [H, T, D]
    V = {l: torch.cat(vs[l], dim=1) for l in layers}
    h, t, d = K[layers[0]].shape
    meta = {"text": args.text, "tokens_per_head": str(t), "rope_theta": repr(theta), "rope_dim": str(rope_dim), "layers": str(len(layers)), "kv_heads": str(h), "head_dim": str(d),
            "row_layout": "row = (layer*kv_heads + head)*tokens + t", "model": gguf.name,
            "dtype_of_run": str(dtype), "what": "post-RoPE keys as the KV cache stores them"}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    keys = torch.stack([K[l] for l in layers]).reshape(-1, d).contiguous()
    values = torch.stack([V[l] for l in layers]).reshape(-1, d).contiguous()
    save_file({"keys": keys}, str(args.out_dir / f"keys-{args.text}.safetensors"), metadata=meta)
    save_file({"values": values}, str(args.out_dir / f"values-{args.text}.safetensors"), metadata={**meta, "what": "values"})
    per = {f"k.L{l:02d}": K[l].contiguous() for l in layers} | {f"v.L{l:02d}": V[l].contiguous() for l in layers}
    per["positions"] = torch.arange(args.tokens, dtype=torch.int64).repeat(args.windows)
    save_file(per, str(args.out_dir / f"kv-{args.text}-per-layer.safetensors"), metadata=meta)
    wo = []
    for lyr in model.model.layers:
        w = lyr.self_attn.o_proj.weight.detach().float().cpu()  # [hidden, Hq * D]
        wo.append(w.pow(2).sum(dim=0).reshape(h, -1, d).sum(dim=1))  # [Hkv, D]
    wo = [x / (resid[i] / resid_n) for i, x in enumerate(wo)]
    weights = {"k.weight": torch.stack([cap.qe[l] / cap.qn[l] for l in layers]).contiguous(), "v.weight": torch.stack(wo).contiguous()}
    save_file(weights, str(args.out_dir / f"kv-{args.text}-weights.safetensors"),
              metadata={**meta, "what": "k.weight: mean query energy per pre-RoPE key channel (RoPE pairs averaged), summed over the query heads of the kv head; "
                                "v.weight: o_proj column energy per value channel, summed over those query heads, over the mean residual energy entering the layer"})
    norms = keys.float().norm(dim=1)
    log(f"wrote {args.out_dir}/keys-{args.text}.safetensors: {tuple(keys.shape)} (key norm mean {norms.mean():.2f}, max {norms.max():.2f})")
    for g, b in ((16, 6), (16, 4), (32, 3)):
        print(f"cargo run --release -p kvforge -- codebook train --samples {args.out_dir}/keys-{args.text}.safetensors "
              f"--group {g} --angle-bits {b} --out codebooks/sph_g{g}_b{b}.safetensors")


if __name__ == "__main__":
    main()
