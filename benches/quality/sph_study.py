#!/usr/bin/env python3
"""Best-codeword cosine of spherical keys on SmolLM2's real post-RoPE keys (issue 26).

    OMP_NUM_THREADS=1 .venv-torch/bin/python benches/quality/sph_study.py \\
        --train data/keys/kv-emma-per-layer.safetensors --test data/keys/kv-persuasion-per-layer.safetensors \\
        --out benches/results/sph-cosine-cpu-sim-$(date +%F).json --codebooks-dir data/codebooks

Inputs: ``capture_keys.py`` per-layer files (``k.L00`` ... [kv_heads, tokens, head_dim]).
Codebooks are trained on the first (calibration, Emma) and measured on the second text's keys,
so no number is a train = test fit. For each (group, angle bits) configuration and variant:

* ``uniform``: one codebook trained on uniform random unit vectors, copied to every layer,
  head and group (the shipped ``codebooks/sph_g*_b*.safetensors`` for the seed's three
  configurations; trained here with the same recipe for the others),
* ``shared``: one codebook trained on every layer's, head's and group's Emma keys (what
  ``kvforge codebook train --samples`` gives today),
* ``per-head``: one codebook per (layer, kv head, group) trained on that group's Emma keys,
* ``rot-uniform`` / ``rot-per-head``: the same after the random-sign Hadamard rotation of
  the whole key (``sph.rotate``, seed 0x5EED) before grouping.

Measured per (layer, kv head, group): mean over test tokens of the best codeword's cosine
with the group's direction; per variant also the relative key error ‖k − k̂‖/‖k‖ with the
8-bit radius (scales from the test keys' max x 1.25, as the sim), against int8/int4/int2
per-channel keys (block 64, fp16 scale/zero: ``sim:int*``'s keys).
``--save-codebooks`` writes the per-head codebooks ([L, H, G, E, group]) for ``sim:sph``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
import sph  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SEED_CONFIGS = {(16, 6): "sph_g16_b6", (16, 4): "sph_g16_b4", (32, 3): "sph_g32_b3"}


def load_keys(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    t = load_file(str(path))
    layers = sorted(k for k in t if k.startswith("k.L"))
    return torch.stack([t[k].float() for k in layers])  # [L, H, T, D]


def groups_of(k: torch.Tensor, group: int) -> torch.Tensor:
    """[L, H, T, D] -> [L*H*G, T, group] (batch row = (layer, head, group))."""
    l, h, t, d = k.shape
    return k.reshape(l, h, t, d // group, group).permute(0, 1, 3, 2, 4).reshape(l * h * (d // group), t, group)


def key_bytes(d: int, group: int, bits: int) -> int:
    """Key bytes per token per kv head: an 8-bit radius and a bit-packed index per group."""
    ng = d // group
    return ng + math.ceil(ng * bits / 8)


def rel_err(k: torch.Tensor, kq: torch.Tensor) -> float:
    """Mean over (layer, head, token) of ‖k − k̂‖ / ‖k‖; k [L, H, T, D]."""
    return ((kq - k).norm(dim=-1) / k.norm(dim=-1).clamp_min(1e-12)).mean().item()


def dequant(k: torch.Tensor, cbs: torch.Tensor) -> torch.Tensor:
    """k [L, H, T, D]; cbs [L, H, G, E, group] -> spherical keys with 8-bit radius."""
    out = []
    for l in range(k.shape[0]):
        group = cbs.shape[-1]
        out.append(sph.quantize_keys(k[l], cbs[l], sph.radius_scales(k[l], group)))
    return torch.stack(out)


def summarise(cos: torch.Tensor, shape) -> dict:
    """cos [L*H*G] of per-(layer, head, group) mean cosines."""
    c = cos.reshape(shape)
    return {"mean": round(c.mean().item(), 4), "min": round(c.min().item(), 4), "p10": round(c.flatten().quantile(0.1).item(), 4),
            "max": round(c.max().item(), 4), "per_layer": [round(x, 4) for x in c.mean(dim=(1, 2)).tolist()],
            "per_layer_head_group": [[[round(x, 3) for x in hg] for hg in lh] for lh in c.tolist()]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, default=kvq.DATA / "keys/kv-emma-per-layer.safetensors")
    ap.add_argument("--test", type=Path, default=kvq.DATA / "keys/kv-persuasion-per-layer.safetensors")
    ap.add_argument("--configs", default="16x6,16x4,32x3,8x8,4x8,8x6,8x4,4x6,4x4", help="group x angle bits, comma-separated")
    ap.add_argument("--variants", default="uniform,shared,per-head,rot-uniform,rot-per-head")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--shared-samples", type=int, default=262144)
    ap.add_argument("--seed", type=lambda s: int(s, 0), default=sph.DEFAULT_SEED, help="rotation seed")
    ap.add_argument("--save-codebooks", type=Path, help="folder for the per-head codebooks (sph-g{G}b{B}[-rot].safetensors)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    t_start = time.time()
    ktr, kte = load_keys(args.train), load_keys(args.test)
    L, H, T, D = kte.shape
    kvq.log(f"train {tuple(ktr.shape)} test {tuple(kte.shape)}")
    rtr, rte = sph.rotate(ktr, args.seed), sph.rotate(kte, args.seed)
    variants = args.variants.split(",")
    res = {"what": "best-codeword cosine of spherical key groups, per (layer, kv head, group), codebooks trained on --train, measured on --test",
           "train": args.train.name, "test": args.test.name, "layers": L, "kv_heads": H, "tokens_test": T, "tokens_train": ktr.shape[2], "head_dim": D,
           "rotation": {"kind": "random-sign Hadamard (ROTATED.md)", "seed": hex(args.seed)}, "kmeans_iters": args.iters,
           "reference_keys": {}, "configs": []}
    for name, bits in (("int8", 8), ("int4", 4), ("int2", 2)):
        kq = torch.stack([kvq.quantize_int_keys(kte[l], bits, 64, "fp16") for l in range(L)])
        res["reference_keys"][name] = {"key_bytes": D * bits / 8 + 4 * D / 64, "rel_err": round(rel_err(kte, kq), 4),
                                       "cosine": round(torch.nn.functional.cosine_similarity(kq, kte, dim=-1).mean().item(), 4)}
        kvq.log(f"{name}: {res['reference_keys'][name]}")
    for cfg in args.configs.split(","):
        group, bits = (int(x) for x in cfg.split("x"))
        e, ng = 1 << bits, D // group
        row = {"group": group, "angle_bits": bits, "entries": e, "key_bytes_d64": key_bytes(64, group, bits), "key_bytes_d128": key_bytes(128, group, bits),
               "lut_bytes_gqa3_d64": 3 * ng * e * 4, "variants": {}}
        for var in variants:
            t0 = time.time()
            rot = var.startswith("rot-")
            tr, te = (rtr, rte) if rot else (ktr, kte)
            gte = sph.unit(groups_of(te, group))  # [L*H*G, T, group]
            base = var.removeprefix("rot-")
            if base == "uniform":
                if not rot and (group, bits) in SEED_CONFIGS:
                    from safetensors.torch import load_file

                    cb = load_file(str(ROOT / "codebooks" / f"{SEED_CONFIGS[(group, bits)]}.safetensors"))["codebook"].float()
                    src = f"codebooks/{SEED_CONFIGS[(group, bits)]}.safetensors"
                else:
                    g = torch.Generator().manual_seed(group * 1000 + bits)
                    cb = sph.kmeans(torch.randn(1, 16384, group, generator=g), e, args.iters, seed=group * 1000 + bits)[0]
                    src = "16384 uniform unit vectors, torch k-means"
                w = cb[None].expand(gte.shape[0], e, group)
            elif base == "shared":
                gtr = groups_of(tr, group).reshape(1, -1, group)
                sel = torch.randperm(gtr.shape[1])[:args.shared_samples]
                w = sph.kmeans(gtr[:, sel], e, args.iters, seed=1)[0][None].expand(gte.shape[0], e, group)
                src = f"{min(args.shared_samples, gtr.shape[1])} groups of every layer/head, train text"
            elif base == "per-head":
                w = sph.kmeans(groups_of(tr, group), e, args.iters, seed=2)
                src = "per (layer, kv head, group), train text"
                if args.save_codebooks:
                    from safetensors.torch import save_file

                    args.save_codebooks.mkdir(parents=True, exist_ok=True)
                    meta = {"trained_on": f"samples from {args.train.name} (sph_study.py, torch k-means)", "group": str(group), "angle_bits": str(bits),
                            "layers": str(L), "kv_heads": str(H), "head_dim": str(D), "basis": f"hadamard:{args.seed:#x}" if rot else "identity"}
                    save_file({"codebooks": w.reshape(L, H, ng, e, group).contiguous()},
                              str(args.save_codebooks / f"sph-g{group}b{bits}{'-rot' if rot else ''}.safetensors"), metadata=meta)
            else:
                raise SystemExit(f"unknown variant {var}")
            cos = sph.best_cosine(gte, w).mean(dim=1)  # [L*H*G]
            cbs = w.reshape(L, H, ng, e, group)
            kq = dequant(te, cbs)
            if rot:
                kq, ref = sph.unrotate(kq, args.seed), kte
            else:
                ref = kte
            s = summarise(cos, (L, H, ng))
            s |= {"key_rel_err": round(rel_err(ref, kq), 4), "codebook": src, "seconds": round(time.time() - t0, 1)}
            row["variants"][var] = s
            kvq.log(f"g{group} b{bits} {var:13s} cos mean {s['mean']:.4f} min {s['min']:.4f} p10 {s['p10']:.4f}  key err {s['key_rel_err']:.4f}  ({s['seconds']}s)")
        res["configs"].append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    res["seconds"] = round(time.time() - t_start, 1)
    args.out.write_text(json.dumps(res, indent=1))
    kvq.log(f"wrote {args.out} in {res['seconds']}s")


if __name__ == "__main__":
    main()
