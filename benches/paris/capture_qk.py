#!/usr/bin/env python3
"""Capture SmolLM2's post-RoPE queries and keys for the ParisKV recall study
(``crates/kvforge-lab/examples/paris_recall.rs --qk``).

    python benches/paris/capture_qk.py --model /root/m --device cuda --tokens 8192 --out qk-emma.safetensors
    python benches/paris/capture_qk.py --device cpu --tokens 4096 --layers 3,15,27   # CPU, a few minutes

Wraps ``benches/quality/capture_keys.py``'s capture backend (exact attention, the model's own
K/V) and keeps the queries too. Output: ``k.LNN`` ``[Hkv, T, D]`` and ``q.LNN`` ``[Hq, T, D]``
(fp16) per captured layer; metadata names the text, model and window.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "quality"))
import capture_keys  # noqa: E402
import kvq  # noqa: E402
from kvq import log  # noqa: E402


class QKBackend(capture_keys.CaptureBackend):
    """The capture backend, plus each layer's queries ([Hq, T, D]) for the layers asked for."""

    name = "capture-qk"

    def __init__(self, layers, rope_dim: int):
        super().__init__(rope_dim)
        self.layers = layers
        self.q = {}

    def reset(self):
        super().reset()
        self.q = {}

    def attend(self, layer, q, k, v, scaling):
        if self.layers is None or layer in self.layers:
            self.q[layer] = q.detach().to("cpu", torch.float16)
        return super().attend(layer, q, k, v, scaling)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--data", type=Path, default=kvq.DATA)
    ap.add_argument("--text", default=kvq.CALIBRATION_BOOK)
    ap.add_argument("--tokens", type=int, default=8192, help="window length (SmolLM2's context is 8192)")
    ap.add_argument("--start", type=int, default=0, help="first token of the window in the text")
    ap.add_argument("--layers", default="", help="comma-separated layers to keep (default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=kvq.DATA / "keys" / "qk-emma.safetensors")
    args = ap.parse_args()
    from safetensors.torch import save_file

    layers = {int(x) for x in args.layers.split(",") if x} or None
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    gguf = kvq.find_gguf(args.model)
    model, tok = kvq.load_model(gguf, args.device, dtype)
    ids = kvq.book_tokens(tok, args.text, args.data)[args.start:args.start + args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"{args.text} has only {args.start + len(ids)} tokens")
    cap = QKBackend(layers, kvq.rope_params(model)[1])
    kvq.set_backend(cap)
    t0 = time.time()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids], device=args.device), use_cache=False)
    log(f"{args.tokens} tokens in {time.time() - t0:.1f}s")
    out = {}
    for layer in sorted(cap.q):
        out[f"k.L{layer:02d}"] = cap.k[layer].contiguous()
        out[f"q.L{layer:02d}"] = cap.q[layer].contiguous()
    k0 = next(iter(out.values()))
    theta, rot = kvq.rope_params(model)
    meta = {"rope_theta": repr(theta), "rope_dims": str(rot), "rope": "rotate_half pairs (i, i + D/2), frequencies theta^(-2i/D)",
            "text": args.text, "start": str(args.start), "tokens": str(args.tokens), "model": gguf.name, "dtype_of_run": str(dtype),
            "what": "post-RoPE keys k.LNN [Hkv,T,D] and queries q.LNN [Hq,T,D] (fp16)", "head_dim": str(k0.shape[-1])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out), metadata=meta)
    log(f"wrote {args.out}: {len(out) // 2} layers, k {tuple(k0.shape)}")


if __name__ == "__main__":
    main()
