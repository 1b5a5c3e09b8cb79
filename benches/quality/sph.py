"""Spherical keys with per-(layer, kv head, group) codebooks and an optional Hadamard rotation
(issue 26, "Spherical keys, honestly"): torch helpers shared by ``sph_study.py`` (codeword
cosines) and ``kvq.py``'s ``sim:sph`` backend (perplexity).

* ``signs(d, seed)`` / ``rotate(x, seed)`` / ``unrotate(y, seed)``: the random-sign Hadamard
  rotation of the ``rotated`` scheme's contract (R = H·diag(s)/√d, signs from the u32 hash of
  the channel and the seed, in-place fast Walsh–Hadamard transform).
* ``kmeans(x, entries, ...)``: batched spherical k-means, the torch analogue of
  ``kvforge_ref::train_codebook`` (init from distinct samples, empty clusters re-seeded with the
  worst-served samples); not bit-identical to it.
* ``quantize_keys(k, codebooks, rscale)``: 8-bit radius x nearest codeword with one codebook
  per (kv head, group), as the spherical kernels read their ``codebook`` side table.
* ``load_per_head(path)``: a ``kvforge codebook train --per-head`` file: tensor ``codebooks``
  [layers, kv_heads, groups, entries, group] (F32) and its metadata.
"""

from __future__ import annotations

import math

import torch

DEFAULT_SEED = 0x5EED
_M32 = 0xFFFFFFFF


def _sign(c: int, seed: int) -> float:
    h = (c ^ ((seed * 0x9E3779B9) & _M32)) & _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return -1.0 if h & 1 else 1.0


def signs(d: int, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """s ∈ {±1}^d of the rotation with ``seed`` (ROTATED.md)."""
    return torch.tensor([_sign(c, seed) for c in range(d)], dtype=torch.float32)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform over the last dim (a power of two)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two")
    shape = x.shape
    y = x.reshape(-1, d).clone()
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape)


def rotate(x: torch.Tensor, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """y = H·diag(s)·x / √d over the last dim."""
    d = x.shape[-1]
    return fwht(x * signs(d, seed).to(x.device, x.dtype)) / math.sqrt(d)


def unrotate(y: torch.Tensor, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """x = diag(s)·H·y / √d (R is orthogonal)."""
    d = y.shape[-1]
    return fwht(y) / math.sqrt(d) * signs(d, seed).to(y.device, y.dtype)


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def kmeans(x: torch.Tensor, entries: int, iters: int = 25, seed: int = 0, chunk: int = 64) -> torch.Tensor:
    """Spherical k-means per batch row: x [B, N, g] (any norms; zero rows ignored by their
    weight) -> unit codewords [B, entries, g]. Batches of ``chunk`` rows bound the memory of the
    [chunk, N, entries] similarity array."""
    out = []
    gen = torch.Generator().manual_seed(seed)
    for lo in range(0, x.shape[0], chunk):
        xb = x[lo:lo + chunk].float()
        valid = (xb.norm(dim=-1) > 1e-8).float()  # [b, N]
        u = unit(xb)
        b, n, g = u.shape
        pick = torch.stack([torch.randperm(n, generator=gen)[:entries] for _ in range(b)])  # [b, E]
        w = torch.gather(u, 1, pick[..., None].expand(b, entries, g)).clone()
        for _ in range(iters):
            sim = torch.bmm(u, w.transpose(1, 2))  # [b, N, E]
            best, idx = sim.max(dim=-1)
            sums = torch.zeros(b, entries, g).scatter_add_(1, idx[..., None].expand(b, n, g), u * valid[..., None])
            norms = sums.norm(dim=-1)  # [b, E]
            empty = norms <= 1e-8
            neww = sums / norms.clamp_min(1e-12)[..., None]
            if empty.any():  # re-seed empty clusters with the worst-served samples
                worst = (best + 2.0 * (1 - valid)).argsort(dim=1)[:, :entries]  # [b, E]
                repl = torch.gather(u, 1, worst[..., None].expand(b, entries, g))
                neww = torch.where(empty[..., None], repl, neww)
            w = neww
        out.append(w)
    return torch.cat(out)


def best_cosine(u: torch.Tensor, w: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """u [B, N, g] unit, w [B, E, g] -> best-codeword cosine [B, N]."""
    return torch.cat([torch.bmm(u[i:i + chunk], w[i:i + chunk].transpose(1, 2)).amax(dim=-1) for i in range(0, u.shape[0], chunk)])


def radius_scales(k: torch.Tensor, group: int, headroom: float = 1.25) -> torch.Tensor:
    """[H, D/group]: max over tokens of the group norm x headroom / 255 (as kvq.radius_scales)."""
    h, t, d = k.shape
    r = k.reshape(h, t, d // group, group).norm(dim=3).amax(dim=1)
    return torch.where(r > 0, r * headroom / 255.0, torch.ones_like(r))


def quantize_keys(k: torch.Tensor, codebooks: torch.Tensor, rscale: torch.Tensor) -> torch.Tensor:
    """k [H, T, D] f32; codebooks [H, G, E, group] unit rows; rscale [H, G] -> dequantised keys
    (8-bit radius code x nearest codeword of the (head, group)'s own codebook)."""
    h, t, d = k.shape
    _, ng, e, group = codebooks.shape
    g = k.reshape(h, t, ng, group).permute(0, 2, 1, 3)  # [H, G, T, group]
    r = g.norm(dim=-1)
    u = g / (r[..., None] + 1e-6)
    cb = codebooks.reshape(h * ng, e, group)
    idx = torch.bmm(u.reshape(h * ng, t, group), cb.transpose(1, 2)).argmax(dim=-1)  # [H*G, T]
    words = torch.gather(cb, 1, idx[..., None].expand(h * ng, t, group)).reshape(h, ng, t, group)
    rs = rscale[:, :, None]
    rcode = torch.floor(r / rs + 0.5).clamp(0, 255)
    return (words * (rcode * rs)[..., None]).permute(0, 2, 1, 3).reshape(h, t, d)


def load_per_head(path) -> tuple[torch.Tensor, dict]:
    """Per-(layer, kv head, group) codebooks [L, H, G, E, group] and the file's metadata."""
    import json
    import struct

    from safetensors.torch import load_file

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n)).get("__metadata__", {}) or {}
    t = load_file(str(path))
    if "codebooks" not in t:
        raise SystemExit(f"{path}: no tensor `codebooks` (a `kvforge codebook train --per-head` file)")
    return t["codebooks"].float(), meta
