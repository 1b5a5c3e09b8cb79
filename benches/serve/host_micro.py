"""Host time of one layer's ``Cache.decode`` in a decode loop (issue 29), re-planned vs the
device-resident plan.

One ``kvforge.Cache`` (Llama-8B attention shape: Hkv 8, gqa 4, head_dim 128) holds ``batch``
sequences of ``context`` tokens, tiled on the device and then staggered (sequence i gets
``i * 64 // batch`` more tokens, so tails fill at different steps, as in serving). Each step
appends one token per sequence (``Cache.append_step``) and decodes the batch; the host time
of the ``decode`` call is summed with ``time.perf_counter``; the GPU is synchronised only at
the end of the ``steps`` steps (wall time per step beside it). Modes: ``replan``
(``decode(..., replan=True)``: every page planned and uploaded, flags read back after each
call) and ``resident`` (the default ``decode``). JSON to ``--out``.

    python3 benches/serve/host_micro.py [--batch 64] [--context 32768] [--steps 64] [--tier b4] --out host-micro.json
"""

import argparse
import json
import time
from pathlib import Path

import torch

import kvforge
from micro import run_modes, summary

ROOT = str(Path(__file__).resolve().parents[2])


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="specs/rdkv.toml")
    ap.add_argument("--tier", default="b4")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--modes", default="replan,resident")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def build(a, dev, hkv=8, gqa=4, d=128):
    c = kvforge.Cache(a.spec, head_dim=d, num_kv_heads=hkv, gqa=gqa, max_tokens=a.batch * (a.context + 2 * a.steps + 256),
                      sequences=a.batch, target=a.tier, root=ROOT, device=dev.index or 0, target_only=True)
    p = c.page_tokens
    full = a.context // p
    t = max((t for t in range(1, min(full, 16) + 1) if full % t == 0), default=0)
    tl = t * p + a.context % p
    g = torch.Generator(device=dev).manual_seed(0)
    s0 = c.add_sequence()
    c.append(s0, torch.randn(tl, hkv, d, device=dev, dtype=torch.float16, generator=g), torch.randn(tl, hkv, d, device=dev, dtype=torch.float16, generator=g))
    seqs = c.tile_sequence(s0, a.batch, a.context)
    # Stagger: sequence i gets i * p // batch more tokens.
    for r in range(p - 1):
        sub = [s for i, s in enumerate(seqs) if i * p // a.batch > r]
        if not sub:
            break
        kv = torch.randn(len(sub), hkv, d, device=dev, dtype=torch.float16, generator=g)
        c.append_step(sub, kv, kv)
    torch.cuda.synchronize()
    return c, seqs


def run(a, mode, dev, hkv=8, gqa=4, d=128):
    t0 = time.perf_counter()
    c, seqs = build(a, dev)
    setup_s = time.perf_counter() - t0
    b = len(seqs)
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(b, hkv * gqa, d, device=dev, dtype=torch.float16, generator=g)
    kv = torch.randn(b, hkv, d, device=dev, dtype=torch.float16, generator=g)
    out = torch.empty(b, hkv * gqa, d, device=dev, dtype=torch.float16)
    lse = torch.empty(b, hkv * gqa, device=dev, dtype=torch.float32)
    replan = mode == "replan"
    # Warm-up: kernels compiled and loaded, the resident plan built.
    c.append_step(seqs, kv, kv)
    c.decode(q, seqs=seqs, out=out, lse=lse, replan=replan)
    torch.cuda.synchronize()
    host_decode, host_append = [], []
    t_wall = time.perf_counter()
    for _ in range(a.steps):
        t = time.perf_counter()
        c.append_step(seqs, kv, kv)
        host_append.append(time.perf_counter() - t)
        t = time.perf_counter()
        c.decode(q, seqs=seqs, out=out, lse=lse, replan=replan)
        host_decode.append(time.perf_counter() - t)
    t_sync = time.perf_counter()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t_wall
    if not replan:
        c.synchronize()  # raises any kernel fault the steps flagged
    row = {"mode": mode, "batch": b, "context": a.context, "steps": a.steps, "tier": a.tier, **summary(host_decode, 1e3, "decode_host_ms"),
           "append_host_ms_mean": summary(host_append, 1e3, "a")["a_mean"],
           "wall_ms_per_step": 1e3 * wall / a.steps, "host_loop_ms_per_step": 1e3 * (t_sync - t_wall) / a.steps,
           "final_sync_ms": 1e3 * (time.perf_counter() - t_sync), "setup_s": setup_s,
           "resident_stats": c.resident_stats()}
    print(json.dumps(row), flush=True)
    del c
    torch.cuda.empty_cache()
    return row


def main():
    a = parse()
    dev = torch.device("cuda")
    header = {"device": torch.cuda.get_device_name(dev), "kvforge": getattr(kvforge, "__version__", None), "torch": torch.__version__}
    return run_modes(a, a.modes.split(","), lambda mode: run(a, mode, dev), header)


if __name__ == "__main__":
    main()
