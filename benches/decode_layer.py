"""Decode-step time of one Llama-3-8B-shaped layer on the GPU, what RDR's per-step cost is
compared with besides the attention kernels alone (issue 7: "< 2% of decode step time at 32K";
`prefill_sdpa.py` is the same layer's prefill, RDKV's reference).

usage: python3 benches/decode_layer.py [context=32768] [batches=1,8]

Times, with CUDA events (median of 50 after 5 warm-ups, a 256 MB buffer written between runs
so neither weights nor cache come from L2), fp16, one new token per sequence:
  qkvo: the Q/K/V projections (4096 -> 4096 + 1024 + 1024) and the output projection;
  mlp: gate/up (4096 -> 2 x 14336) and down (14336 -> 4096);
  sdpa: torch SDPA decode over a dense fp16 cache of `context` tokens, 32 q / 8 kv heads, d 128.
Prints one JSON line per batch: each part, `dense_layer_us` = qkvo + mlp + sdpa, and
`weights_us` = qkvo + mlp (add a kvforge decode's kernel time to it for a kvforge layer step).
Norms, RoPE and sampling are left out (they only make the step longer).
"""
import json
import sys

import torch
import torch.nn.functional as F

from cuda_timing import timed


def main():
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8]
    hq, hkv, d, hidden, inter = 32, 8, 128, 4096, 14336
    dev, dt = "cuda", torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    flush = torch.empty(64 * 1024 * 1024, device=dev, dtype=torch.float32)
    wqkv = torch.randn(hidden, hidden + 2 * hkv * d, device=dev, dtype=dt, generator=g) * 0.02
    wo = torch.randn(hidden, hidden, device=dev, dtype=dt, generator=g) * 0.02
    wgu = torch.randn(hidden, 2 * inter, device=dev, dtype=dt, generator=g) * 0.02
    wd = torch.randn(inter, hidden, device=dev, dtype=dt, generator=g) * 0.02
    for b in batches:
        x = torch.randn(b, hidden, device=dev, dtype=dt, generator=g)
        h = torch.randn(b, inter, device=dev, dtype=dt, generator=g)
        q = torch.randn(b, hq, 1, d, device=dev, dtype=dt, generator=g)
        k = torch.randn(b, hkv, t, d, device=dev, dtype=dt, generator=g)
        v = torch.randn(b, hkv, t, d, device=dev, dtype=dt, generator=g)
        qkvo = timed(lambda: (x @ wqkv, x @ wo), 50, 5, flush)
        mlp = timed(lambda: (x @ wgu, h @ wd), 50, 5, flush)
        sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 50, 5, flush)
        print(json.dumps({
            "kind": "decode_layer",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "batch": b, "context": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "hidden": hidden, "intermediate": inter, "dtype": "fp16",
            "qkvo_proj_us": round(qkvo, 1), "mlp_us": round(mlp, 1), "sdpa_decode_us": round(sdpa, 1),
            "weights_us": round(qkvo + mlp, 1), "dense_layer_us": round(qkvo + mlp + sdpa, 1),
        }), flush=True)
        del k, v


if __name__ == "__main__":
    main()
