#!/usr/bin/env python3
"""Which RoPE pairing kvtc must undo: the share of variance in the top-16 principal components
of one layer's keys (3 kv heads x 64 channels, tokens 4..T-128) as captured (post-RoPE), with
transformers' rotate_half RoPE undone (channel i with i + d/2, what kvforge-kvtc does) and with
the interleaved pairing (2i, 2i+1, llama.cpp's) undone. The right pairing concentrates the
variance; the wrong one does not.

    python3 benches/quality/kvtc_rope_check.py data/keys/kv-emma-per-layer.safetensors
"""

import sys

import numpy as np
from safetensors import safe_open


def top_share(x, k=16):
    x = x - x.mean(0)
    ev = np.linalg.eigvalsh(x.T @ x)[::-1]
    return ev[:k].sum() / ev.sum()


def main():
    path = sys.argv[1]
    with safe_open(path, "np") as f:
        meta = f.metadata()
        theta, d = float(meta["rope_theta"]), int(meta["rope_dim"])
        layers = int(meta["layers"])
        half = d // 2
        inv = theta ** (-2 * np.arange(half) / d)
        for l in sorted({0, layers // 6, layers // 2, layers - 1}):
            k = f.get_tensor(f"k.L{l:02d}").astype(np.float64)
            t = np.arange(k.shape[1])[4:-128]
            k = k[:, 4:-128]
            c, s = np.cos(t[:, None] * inv), np.sin(t[:, None] * inv)
            a, b = k[..., :half], k[..., half:]
            rh = np.concatenate([a * c + b * s, b * c - a * s], -1)
            a, b = k[..., 0::2], k[..., 1::2]
            il = np.empty_like(k)
            il[..., 0::2], il[..., 1::2] = a * c + b * s, b * c - a * s
            flat = lambda x: x.transpose(1, 0, 2).reshape(x.shape[1], -1)  # noqa: E731
            print(f"layer {l:2d}: top-16 variance share: post-RoPE {top_share(flat(k)):.3f}, "
                  f"rotate_half undone {top_share(flat(rh)):.3f}, interleaved undone {top_share(flat(il)):.3f}")


if __name__ == "__main__":
    main()
