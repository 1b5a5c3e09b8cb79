"""Prefill time of one Llama-3-8B-shaped layer at 32K tokens on the GPU, what RDKV's
allocation is compared with (issue 7: "< 1% of prefill time at 32K").

Times, with CUDA events (median of 10 after 3 warm-ups), batch 1, fp16:
  attention: torch SDPA, causal, 32 query heads / 8 kv heads (GQA), head dim 128;
  qkvo: the Q/K/V projections (4096 -> 4096 + 1024 + 1024) and the output projection;
  mlp: gate/up (4096 -> 2 x 14336) and down (14336 -> 4096).
Prints one JSON line: each part and layer = attention + qkvo + mlp (norms, RoPE excluded).
"""
import json
import sys

import torch
import torch.nn.functional as F

from cuda_timing import timed


def main():
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    hq, hkv, d, hidden, inter = 32, 8, 128, 4096, 14336
    dev, dt = "cuda", torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, hq, t, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(1, hkv, t, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, hkv, t, d, device=dev, dtype=dt, generator=g)
    x = torch.randn(t, hidden, device=dev, dtype=dt, generator=g)
    wqkv = torch.randn(hidden, hidden + 2 * hkv * d, device=dev, dtype=dt, generator=g) * 0.02
    wo = torch.randn(hidden, hidden, device=dev, dtype=dt, generator=g) * 0.02
    wgu = torch.randn(hidden, 2 * inter, device=dev, dtype=dt, generator=g) * 0.02
    wd = torch.randn(inter, hidden, device=dev, dtype=dt, generator=g) * 0.02
    attn = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    qkvo = timed(lambda: (x @ wqkv, x @ wo))
    h = torch.empty(t, inter, device=dev, dtype=dt)
    mlp = timed(lambda: (x @ wgu, h @ wd))
    print(json.dumps({
        "kind": "prefill_layer",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "hidden": hidden, "intermediate": inter, "dtype": "fp16",
        "sdpa_causal_us": round(attn, 1), "qkvo_proj_us": round(qkvo, 1), "mlp_us": round(mlp, 1),
        "layer_us": round(attn + qkvo + mlp, 1),
    }))


if __name__ == "__main__":
    main()
