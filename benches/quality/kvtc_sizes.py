#!/usr/bin/env python3
"""kvtc sizes and reconstruction error on one real cache (no attention): one exact forward of
a window of an evaluation text, then ``kvforge pack`` / ``unpack`` of its K/V at every ratio of
the calibration with DEFLATE (the paper's), zstd and no entropy coding. Writes JSON rows:
ratio, entropy, compression before/after entropy coding, whole-container ratio, bytes per
token per kv head, relative K and V error of the compressed tokens, pack/unpack seconds.

    KVFORGE_KVTC_CAL=/tmp/kvtc/cal.safetensors python3 benches/quality/kvtc_sizes.py --model /root/m \\
        --text persuasion --ctx 2048 --out $OUT/kvtc-sizes.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
from kvq import log  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--data", type=Path, default=kvq.DATA)
    ap.add_argument("--text", default="persuasion")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ratios", default="4,8,16,20,32,64")
    ap.add_argument("--entropies", default="deflate,zstd,none")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cal = Path(os.environ["KVFORGE_KVTC_CAL"])
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    model, tok = kvq.load_model(kvq.find_gguf(args.model), args.device, dtype)
    ids = kvq.book_tokens(tok, args.text, args.data)[: args.ctx]
    cap = kvq._CaptureAll()
    kvq.set_backend(cap)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids], device=args.device), use_cache=False)
    from safetensors import safe_open
    with safe_open(str(cal), "np") as f:
        meta = f.metadata()
    sinks, window = int(meta["sinks"]), int(meta["window"])
    sl = slice(sinks, len(ids) - window)
    rows = []
    for r in [float(x) for x in args.ratios.split(",")]:
        for e in args.entropies.split(","):
            t0 = time.time()
            rk, rv, st = kvq.kvtc_roundtrip(cap.k, cap.v, cal, r, e)
            secs = time.time() - t0
            err = {}
            for name, a, b in (("k", cap.k, rk), ("v", cap.v, rv)):
                num = sum(((a[l][:, sl].float() - b[l][:, sl].float()) ** 2).sum().item() for l in a)
                den = sum((a[l][:, sl].float() ** 2).sum().item() for l in a)
                err[f"rel_err_{name}"] = (num / den) ** 0.5
            row = {"ratio": r, "entropy": e, **err, "roundtrip_seconds": secs, **st}
            rows.append(row)
            log(f"kvtc {r:>4}x {e:<7}: {st['ratio_before_entropy']:.2f}x before, {st['ratio_after_entropy']:.2f}x after, "
                f"{st['ratio_total']:.2f}x whole container, K err {err['rel_err_k']:.4f}, V err {err['rel_err_v']:.4f}")
    args.out.write_text(json.dumps({"text": args.text, "ctx": len(ids), "calibration": str(cal), "sinks": sinks, "window": window,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
