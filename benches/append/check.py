"""Cache.append_step on the GPU: the same cache as Cache.append per sequence (decode outputs
equal for a dense target, close for rotated), and one decode step's write timed both ways.
Usage: python check.py OUT.json (benches/append/on_device.sh)."""
import json
import sys
import time

import torch

import kvforge

B, HKV, G, D = 64, 8, 4, 128


def caches(spec, tier):
    kw = dict(head_dim=D, num_kv_heads=HKV, gqa=G, max_tokens=B * 512, sequences=B, target=tier)
    return kvforge.Cache(spec, **kw), kvforge.Cache(spec, **kw)


def check(spec, tier, exact):
    host, dev = caches(spec, tier)
    seqs = [host.add_sequence() for _ in range(B)]
    assert seqs == [dev.add_sequence() for _ in range(B)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    # prefills of different lengths (some tails about to fill, some sequences empty)
    for s in seqs:
        n = (s * 37) % 130
        if n:
            k = torch.randn(n, HKV, D, dtype=torch.float16, device="cuda", generator=gen)
            v = torch.randn(n, HKV, D, dtype=torch.float16, device="cuda", generator=gen)
            host.append(s, k, v)
            dev.append(s, k, v)
    for step in range(70):
        k = torch.randn(B, HKV, D, dtype=torch.float16, device="cuda", generator=gen)
        v = torch.randn(B, HKV, D, dtype=torch.float16, device="cuda", generator=gen)
        for b, s in enumerate(seqs):
            host.append(s, k[b:b + 1], v[b:b + 1])
        dev.append_step(seqs, k, v)
    q = torch.randn(B, HKV * G, D, dtype=torch.float16, device="cuda", generator=gen)
    (oh, _), (od, _) = host.decode(q, seqs=seqs), dev.decode(q, seqs=seqs)
    diff = (oh.float() - od.float()).abs().max().item()
    ok = diff == 0.0 if exact else diff < 5e-2
    return {"spec": spec, "tier": tier, "decode_max_abs_diff": diff, "ok": ok}


def timing(spec, tier, steps=50):
    host, dev = caches(spec, tier)
    seqs = [host.add_sequence() for _ in range(B)]
    [dev.add_sequence() for _ in range(B)]
    k = torch.randn(B, HKV, D, dtype=torch.float16, device="cuda")
    out = {}
    for name, c, write in (("append_per_seq", host, lambda c: [c.append(s, k[b:b + 1], k[b:b + 1]) for b, s in enumerate(seqs)]),
                           ("append_step", dev, lambda c: c.append_step(seqs, k, k))):
        for _ in range(3):
            write(c)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            write(c)
        torch.cuda.synchronize()
        out[name + "_ms_per_step"] = (time.perf_counter() - t) / steps * 1e3
    out["speedup"] = out["append_per_seq_ms_per_step"] / out["append_step_ms_per_step"]
    return {"spec": spec, "tier": tier, "batch": B, "kv_heads": HKV, "head_dim": D, **out}


def main():
    res = {"device": torch.cuda.get_device_name(), "checks": [], "timing": []}
    for spec, tier, exact in (("specs/baseline.toml", "fp16", True), ("specs/rdkv.toml", "b4", True), ("specs/rotated.toml", "r4", False)):
        r = check(spec, tier, exact)
        print(r, flush=True)
        res["checks"].append(r)
    for spec, tier in (("specs/rdkv.toml", "b4"), ("specs/rotated.toml", "r4")):
        r = timing(spec, tier)
        print(r, flush=True)
        res["timing"].append(r)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
    sys.exit(0 if all(c["ok"] for c in res["checks"]) else 1)


if __name__ == "__main__":
    main()
