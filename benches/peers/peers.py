#!/usr/bin/env python3
"""Peer decode-attention benchmarks (FlashInfer paged decode, torch SDPA) on one GPU.

Same shapes and JSON schema as the kvforge bench (benches/results/*.json):
Hq 32, Hkv 8, d 128, fp16 queries, one query token per sequence, every
sequence of a batch has the same context length.

Systems (--systems):
  flashinfer      BatchDecodeWithPagedKVCacheWrapper, fp16 paged KV (NHD, page 16)
  flashinfer_fp8  the same with an fp8 e4m3 KV cache (fp16 q and output, scales 1)
  sdpa            torch.nn.functional.scaled_dot_product_attention on a dense fp16
                  [batch, heads, ctx, d] cache, one variant per SDPA backend
Variants:
  flashinfer*: tc = use_tensor_cores=True (FA2 prefill kernels), cc = CUDA-core
               decode kernel (use_tensor_cores=False), xqa =
               flashinfer.decode.xqa_batch_decode_with_kv_cache (TensorRT-LLM's XQA
               kernels: on sm_90 an fp8 cache runs the Hopper GMMA/TMA kernel
               mha_sm90.cu, an fp16 cache the mma.sync kernel mha.cu),
               xqa_gmma = the same JIT module called with the Hopper kernel forced
               for an fp16 cache too (mha_sm90.cu compiles an fp16-cache case,
               IS_SUPPORTED_F16_CASE, that the public API never selects; fp16
               system only); --fi-variants
  sdpa:        gqa:<backend> (q [B,32,1,d], k/v [B,8,S,d], enable_gqa=True) and
               fold:<backend> (the 4 query heads of a group folded into the query
               length: q [B,8,4,d], no mask needed for decode, no GQA support
               needed); backends flash, cudnn, efficient; --sdpa-variants

Measurement: CUDA events around the call only (plan()/allocation excluded);
--warmup untimed calls, then --runs timed calls, each preceded by an L2 flush
(zeroing a 256 MB buffer) and a short GPU spin so that host launch overhead
hides behind the GPU work; median / p10 / p90 reported.
bytes_read = K+V bytes of every token + query bytes + output bytes (the kvforge
bench's convention, e.g. 16793600 for 4096 x 1 fp16); gbps = bytes_read / median;
copy_gbps = (read+write bytes) / median time of a 2 GiB device-to-device copy
measured in the same process; bw_fraction = gbps / copy_gbps.

Rows: one per (system, variant, context, batch). Within each (system, context,
batch) the fastest variant is listed first and carries "best": true, so
benches/report.py (which keeps the first row per system/context/batch) shows the
best variant.  Failures are rows {"system", "variant", "context", "batch",
"error"}; the run goes on.  The JSON file is rewritten after every case, so a
killed run still leaves the finished cases.
"""
import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
import traceback

HQ, HKV, D = 32, 8, 128
GROUP = HQ // HKV
DEFAULT_CONTEXTS = [4096, 16384, 32768, 131072]
DEFAULT_BATCHES = [1, 8, 32, 64]
FI_VARIANTS = ["tc", "cc", "xqa", "xqa_gmma"]
SDPA_VARIANTS = ["gqa:flash", "gqa:cudnn", "gqa:efficient", "fold:flash", "fold:cudnn", "fold:efficient"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    ap.add_argument("--runs", type=int, default=25, help="timed runs per case (>= 20 recommended)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="peers.json")
    ap.add_argument("--quick", action="store_true", help="contexts 4096,32768 x batches 1,32 (overrides --contexts/--batches)")
    ap.add_argument("--systems", default="flashinfer,flashinfer_fp8,sdpa")
    ap.add_argument("--fi-variants", default="tc,cc",
                    help="comma list of tc (tensor cores) / cc (CUDA cores) / xqa (XQA decode) / xqa_gmma (XQA, Hopper kernel forced)")
    ap.add_argument("--sdpa-variants", default=",".join(SDPA_VARIANTS))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--page-order", choices=["contiguous", "shuffled"], default="contiguous",
                    help="order of a sequence's pages in the pool (shuffled = random permutation)")
    ap.add_argument("--max-kv-gb", type=float, default=60.0, help="skip cases whose fp16 K+V exceeds this (GB)")
    ap.add_argument("--workspace-mb", type=int, default=512, help="FlashInfer float workspace")
    ap.add_argument("--xqa-workspace-mb", type=int, default=128,
                    help="XQA workspace (its own zeroed buffer: the first 8 MB are semaphores, the rest scratch)")
    ap.add_argument("--flush-mb", type=int, default=256)
    ap.add_argument("--spin-cycles", type=int, default=400_000,
                    help="GPU spin (torch.cuda._sleep) after each flush, before the start event")
    ap.add_argument("--no-check", action="store_true", help="skip the float64 correctness check")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.contexts = [int(x) for x in a.contexts.split(",") if x]
    a.batches = [int(x) for x in a.batches.split(",") if x]
    if a.quick:
        a.contexts, a.batches = [4096, 32768], [1, 32]
    a.systems = [s for s in a.systems.split(",") if s]
    a.fi_variants = [v for v in a.fi_variants.split(",") if v]
    bad = [v for v in a.fi_variants if v not in FI_VARIANTS]
    if bad:
        ap.error(f"--fi-variants: unknown {bad}; known {FI_VARIANTS}")
    a.sdpa_variants = [v for v in a.sdpa_variants.split(",") if v]
    return a


def log(*x):
    print(*x, flush=True)


def setup_env(torch):
    """FlashInfer JIT settings; must run before `import flashinfer`."""
    if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ:
        maj, mnr = torch.cuda.get_device_capability()
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = f"{maj}.{mnr}"
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/flashinfer-ws")
    if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    if os.environ.get("CUDA_HOME"):
        b = os.path.join(os.environ["CUDA_HOME"], "bin")
        if b not in os.environ.get("PATH", "").split(":"):
            os.environ["PATH"] = b + ":" + os.environ.get("PATH", "")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))


# ---------------------------------------------------------------- timing


class Timer:
    def __init__(self, torch, flush_mb, warmup, runs, spin_cycles):
        self.torch = torch
        self.spin_cycles = spin_cycles
        self.flush = torch.empty(flush_mb * 2**20, dtype=torch.uint8, device="cuda")
        self.warmup, self.runs = warmup, runs
        self.spin = getattr(torch.cuda, "_sleep", None)

    def __call__(self, fn):
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.runs)]
        for s, e in ev:
            self.flush.zero_()
            if self.spin is not None and self.spin_cycles > 0:
                self.spin(self.spin_cycles)  # ~200 us of GPU spin: the host enqueue of fn hides behind it
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        t = sorted(s.elapsed_time(e) * 1000.0 for s, e in ev)  # us
        return {"time_us": pct(t, 50), "p10_us": pct(t, 10), "p90_us": pct(t, 90)}


def pct(sorted_vals, p):
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    k = (len(sorted_vals) - 1) * p / 100.0
    f, c = math.floor(k), math.ceil(k)
    return sorted_vals[f] + (sorted_vals[c] - sorted_vals[f]) * (k - f)


def measure_copy_gbps(torch, runs):
    n = 2 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.fill_(1)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(max(runs, 10)):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1000.0)
    ts.sort()
    med = pct(ts, 50)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / med / 1e9


def fill_random_(torch, t, gen, chunk=2**28):
    """Fill t (any float dtype incl. fp8) with N(0,1) values, chunkwise (no full-size fp16 temp)."""
    flat = t.view(-1)
    for i in range(0, flat.numel(), chunk):
        j = min(flat.numel(), i + chunk)
        flat[i:j].copy_(torch.randn(j - i, device="cuda", dtype=torch.float16, generator=gen))
    return t


def elem_bytes(torch, dt):
    return torch.empty((), dtype=dt).element_size()


def bytes_read(torch, ctx, batch, kv_dtype):
    kv = batch * ctx * HKV * D * 2 * elem_bytes(torch, kv_dtype)
    qo = 2 * batch * HQ * D * 2  # fp16 queries read + fp16 output written
    return kv + qo


# ---------------------------------------------------------------- reference


def reference(torch, q, k, v):
    """q [B,HQ,D], k/v [B,S,HKV,D] (any dtype) -> float64 [B,HQ,D]."""
    q = q.double().view(q.shape[0], HKV, GROUP, D)
    k, v = k.double(), v.double()
    s = torch.einsum("bhgd,bshd->bhgs", q, k) / math.sqrt(D)
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhgs,bshd->bhgd", p, v)
    return o.reshape(q.shape[0], HQ, D)


def rel_err(torch, o, ref):
    o = o.double().reshape(ref.shape)
    return {
        "rel_err": float((o - ref).norm() / ref.norm()),
        "max_abs_err": float((o - ref).abs().max()),
    }


# ---------------------------------------------------------------- FlashInfer


class FlashInferCase:
    """A paged KV cache for (ctx, batch) and one wrapper per variant."""

    def __init__(self, torch, fi, args, ctx, batch, kv_dtype, gen, workspace, xqa_workspace=None):
        self.torch, self.fi, self.args = torch, fi, args
        ps = args.page_size
        self.kv_dtype = kv_dtype
        pages_per_seq = (ctx + ps - 1) // ps
        num_pages = batch * pages_per_seq
        self.cache = torch.empty(num_pages, 2, ps, HKV, D, dtype=kv_dtype, device="cuda")
        fill_random_(torch, self.cache, gen)
        if args.page_order == "shuffled":
            indices = torch.randperm(num_pages, device="cuda", generator=gen)
        else:
            indices = torch.arange(num_pages, device="cuda")
        self.indices = indices.to(torch.int32)
        self.indptr = (torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pages_per_seq)
        self.last_page_len = torch.full((batch,), ctx - (pages_per_seq - 1) * ps, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, HQ, D, dtype=torch.float16, device="cuda", generator=gen)
        self.out = torch.empty(batch, HQ, D, dtype=torch.float16, device="cuda")
        self.workspace, self.xqa_workspace = workspace, xqa_workspace
        self.ctx, self.batch, self.pages_per_seq = ctx, batch, pages_per_seq

    def wrapper(self, variant):
        """An object with run(q, paged_kv, out=out): a planned FlashInfer wrapper, or an XqaRun."""
        torch, fi = self.torch, self.fi
        if variant in ("xqa", "xqa_gmma"):
            return XqaRun(self, force_gmma=(variant == "xqa_gmma"))
        if variant not in ("tc", "cc"):
            raise ValueError(f"unknown flashinfer variant {variant}")
        w = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=(variant == "tc"))
        w.plan(
            self.indptr, self.indices, self.last_page_len,
            HQ, HKV, D, self.args.page_size,
            pos_encoding_mode="NONE",
            q_data_type=torch.float16,
            kv_data_type=self.kv_dtype,
        )
        return w

    def run_fn(self, w):
        return lambda: w.run(self.q, self.cache, out=self.out)

    def dense_kv(self):
        """K, V as [B, S, HKV, D] in the cache dtype (for the reference)."""
        pages = self.cache[self.indices.long().view(self.batch, self.pages_per_seq)]  # [B,P,2,ps,H,D]
        k = pages[:, :, 0].reshape(self.batch, -1, HKV, D)[:, : self.ctx]
        v = pages[:, :, 1].reshape(self.batch, -1, HKV, D)[:, : self.ctx]
        return k, v


class XqaRun:
    """FlashInfer's XQA decode on a FlashInferCase's cache (no plan step: tables go in the call).

    The public entry, flashinfer.decode.xqa_batch_decode_with_kv_cache, takes the same
    [pages, 2, page_size, Hkv, D] NHD cache (it unbinds K and V, strides preserved), a
    [batch, pages_per_seq] int32 block table (the case's page indices) and uint32
    sequence lengths. bmm1_scale is the whole QK scale (1/sqrt(D)), bmm2_scale the V
    scale (1). On sm_90 flashinfer.xqa.xqa runs mha_sm90.cu (GMMA + TMA) only for an
    fp8 cache and mha.cu (mma.sync) otherwise; force_gmma calls the same JIT module's
    op with that choice forced to the Hopper kernel (which compiles an fp16-cache case).
    """

    def __init__(self, case, force_gmma=False):
        torch, fi = case.torch, case.fi
        if case.xqa_workspace is None:
            raise RuntimeError("XQA needs its own zeroed workspace (xqa_workspace)")
        major = torch.cuda.get_device_capability()[0]
        fp8 = case.kv_dtype == torch.float8_e4m3fn
        if force_gmma:
            if major != 9:
                raise RuntimeError("xqa_gmma: the Hopper XQA kernel needs sm_90")
            if fp8:
                raise RuntimeError("xqa_gmma: an fp8 cache already runs the Hopper kernel in variant xqa")
        self.case, self.force_gmma = case, force_gmma
        self.block_tables = case.indices.view(case.batch, case.pages_per_seq)
        lens = torch.full((case.batch,), case.ctx, dtype=torch.int32, device="cuda")
        self.seq_lens = lens.view(torch.uint32) if hasattr(torch, "uint32") else lens
        self.max_seq_len = case.pages_per_seq * case.args.page_size
        self.scale = 1.0 / math.sqrt(D)
        gmma = force_gmma or (fp8 and major == 9)
        self.resolved_backend = "xqa:mha_sm90" if gmma else "xqa:mha"
        if force_gmma:
            from flashinfer.xqa import get_xqa_module
            from flashinfer.utils import device_support_pdl, get_device_sm_count
            # the arguments flashinfer.xqa.xqa would pass, for one query token, no window/sinks
            self.module = get_xqa_module(torch.float16, case.kv_dtype, case.args.page_size, D, GROUP, False,
                                         torch.float16, 1)
            self.sm_count = get_device_sm_count(case.q.device)
            self.pdl = device_support_pdl(case.q.device)
            ws = case.xqa_workspace.view(torch.uint8)
            self.semaphores, self.scratch = ws[: 8 * 2**20], ws[8 * 2**20:]
        else:
            self.xqa_decode = fi.decode.xqa_batch_decode_with_kv_cache

    def run(self, q, paged_kv, out):
        if not self.force_gmma:
            return self.xqa_decode(q, paged_kv, self.case.xqa_workspace, self.block_tables, self.seq_lens,
                                   self.max_seq_len, bmm1_scale=self.scale, bmm2_scale=1.0, out=out, kv_layout="NHD")
        k, v = paged_kv.unbind(dim=1)
        # q_scale = bmm1_scale / kv_scale * sqrt(D) = 1, kv_scale = 1 (as xqa_batch_decode_with_kv_cache computes)
        self.module.xqa(True, self.sm_count, HKV, 0, 1.0, out.unsqueeze(1), 1.0, q.unsqueeze(1), None, k, v,
                        None, None, self.block_tables, self.max_seq_len, self.seq_lens.unsqueeze(1), q.shape[0],
                        1.0, self.semaphores, self.scratch, self.pdl, 1, None, None)
        return out


# ---------------------------------------------------------------- SDPA


def sdpa_backend(torch, name):
    from torch.nn.attention import SDPBackend
    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


class SdpaCase:
    def __init__(self, torch, ctx, batch, gen):
        self.torch = torch
        self.k = fill_random_(torch, torch.empty(batch, HKV, ctx, D, dtype=torch.float16, device="cuda"), gen)
        self.v = fill_random_(torch, torch.empty(batch, HKV, ctx, D, dtype=torch.float16, device="cuda"), gen)
        self.q = torch.randn(batch, HQ, D, dtype=torch.float16, device="cuda", generator=gen)
        self.batch, self.ctx = batch, ctx

    def run_fn(self, variant):
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        mode, bname = variant.split(":")
        backend = sdpa_backend(torch, bname)
        B = self.batch
        if mode == "gqa":
            q4 = self.q.view(B, HQ, 1, D)

            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q4, self.k, self.v, enable_gqa=True)
        elif mode == "fold":
            q4 = self.q.view(B, HKV, GROUP, D)

            def call():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q4, self.k, self.v)
        else:
            raise ValueError(f"unknown sdpa variant {variant}")
        return call

    def dense_kv(self):
        return self.k.transpose(1, 2), self.v.transpose(1, 2)  # [B,S,HKV,D]


# ---------------------------------------------------------------- driver


def fi_variants(args, system):
    """The --fi-variants that apply to a FlashInfer system: xqa_gmma only forces a choice for fp16 KV
    (an fp8 cache already runs the Hopper XQA kernel in variant xqa)."""
    return [v for v in args.fi_variants if not (v == "xqa_gmma" and system == "flashinfer_fp8")]


def err_row(system, variant, ctx, batch, e):
    msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return {"system": system, "variant": variant, "context": ctx, "batch": batch, "error": msg[:20000]}


def correctness(torch, fi, args, gen, workspace, fi_err, xqa_workspace=None):
    """Every peer variant vs a float64 reference on one small case (ragged last page)."""
    ctx, batch = 1000, 3
    out = []
    for system in args.systems:
        if system.startswith("flashinfer"):
            kv_dtype = torch.float8_e4m3fn if system == "flashinfer_fp8" else torch.float16
            for var in fi_variants(args, system):
                try:
                    if fi is None:
                        raise RuntimeError(f"flashinfer import failed: {fi_err}")
                    t0 = time.time()
                    c = FlashInferCase(torch, fi, args, ctx, batch, kv_dtype, gen, workspace, xqa_workspace)
                    w = c.wrapper(var)  # first plan() of a dtype/variant JIT-compiles its module (XQA: first run)
                    o = c.run_fn(w)()
                    torch.cuda.synchronize()
                    k, v = c.dense_kv()
                    r = {"system": system, "variant": var, **rel_err(torch, o, reference(torch, c.q, k, v)),
                         "plan_and_first_run_s": round(time.time() - t0, 1)}
                    if getattr(w, "resolved_backend", None):
                        r["backend"] = w.resolved_backend
                except Exception as e:
                    traceback.print_exc()
                    r = err_row(system, var, ctx, batch, e)
                log("check", r)
                out.append(r)
                if "error" in r:  # a sticky CUDA error (e.g. a kernel trap) would poison every later case
                    try:
                        torch.cuda.synchronize()
                    except Exception as e:
                        log(f"CUDA context lost after {system}/{var}: {type(e).__name__}: {e}")
        elif system == "sdpa":
            for var in args.sdpa_variants:
                try:
                    c = SdpaCase(torch, ctx, batch, gen)
                    o = c.run_fn(var)()
                    torch.cuda.synchronize()
                    k, v = c.dense_kv()
                    r = {"system": system, "variant": var, **rel_err(torch, o, reference(torch, c.q, k, v))}
                except Exception as e:
                    r = err_row(system, var, ctx, batch, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                log("check", r)
                out.append(r)
    return out


def order_results(results):
    """Per (system, context, batch): fastest variant first and marked best; errors last."""
    groups, order = {}, []
    for r in results:
        key = (r["system"], r.get("context"), r.get("batch"))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(r)
    out = []
    for key in order:
        ok = sorted((r for r in groups[key] if "error" not in r), key=lambda r: r["time_us"])
        for i, r in enumerate(ok):
            r["best"] = i == 0
        out += ok + [r for r in groups[key] if "error" in r]
    return out


def write_json(path, doc):
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


def print_table(doc):
    log(f"\n{doc['device']}  copy {doc['copy_gbps']:.0f} GB/s  versions {doc['versions']}")
    log(f"{'system':<15} {'variant':<15} {'ctx':>7} {'batch':>5} {'time_us':>10} {'p10':>9} {'p90':>9} {'GB/s':>7} {'frac':>5}")
    for r in doc["results"]:
        if "error" in r:
            log(f"{r['system']:<15} {str(r.get('variant')):<15} {str(r.get('context')):>7} {str(r.get('batch')):>5}  ERROR {r['error'][:90]}")
        else:
            log(f"{r['system']:<15} {r['variant']:<15} {r['context']:>7} {r['batch']:>5} {r['time_us']:>10.1f} "
                f"{r['p10_us']:>9.1f} {r['p90_us']:>9.1f} {r['gbps']:>7.0f} {r['bw_fraction']:>5.2f}{' *' if r.get('best') else ''}")
    for c in doc.get("correctness", []):
        if "error" in c:
            log(f"check {c['system']}/{c['variant']}: ERROR {c['error'][:120]}")
        else:
            log(f"check {c['system']}/{c['variant']}: rel_err {c['rel_err']:.2e} max_abs_err {c['max_abs_err']:.2e}")


def safe(fn):
    try:
        return fn()
    except Exception:
        return None


def nvcc_version():
    try:
        nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        txt = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        return txt.strip().splitlines()[-1] if txt.strip() else None
    except Exception:
        return None


def main():
    args = parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("CUDA not available")
    setup_env(torch)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)

    fi, fi_err = None, None
    if any(s.startswith("flashinfer") for s in args.systems):
        try:
            import flashinfer as fi
        except Exception as e:
            traceback.print_exc()
            fi_err = f"{type(e).__name__}: {e}"
    doc = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "copy_gbps": None,
        "versions": {
            "torch": torch.__version__,
            "flashinfer": getattr(fi, "__version__", None),
            "cuda": torch.version.cuda,
            "nvcc": nvcc_version(),
            "cudnn": safe(torch.backends.cudnn.version),
        },
        "config": {
            "num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "page_size": args.page_size,
            "page_order": args.page_order, "runs": args.runs, "warmup": args.warmup,
            "flush_mb": args.flush_mb, "spin_cycles": args.spin_cycles, "workspace_mb": args.workspace_mb,
            "fi_variants": args.fi_variants, "xqa_workspace_mb": args.xqa_workspace_mb,
            "env": {k: os.environ.get(k) for k in ("FLASHINFER_CUDA_ARCH_LIST", "FLASHINFER_WORKSPACE_BASE", "CUDA_HOME")},
        },
        "results": [],
    }
    if fi_err:
        doc["flashinfer_import_error"] = fi_err
    log(f"device {doc['device']}, versions {doc['versions']}")

    doc["copy_gbps"] = measure_copy_gbps(torch, args.runs)
    log(f"copy_gbps {doc['copy_gbps']:.1f}")
    timer = Timer(torch, args.flush_mb, args.warmup, args.runs, args.spin_cycles)
    workspace = torch.zeros(args.workspace_mb * 2**20, dtype=torch.uint8, device="cuda")
    xqa_workspace = None
    if any(v.startswith("xqa") for v in args.fi_variants) and any(s.startswith("flashinfer") for s in args.systems):
        xqa_workspace = torch.zeros(args.xqa_workspace_mb * 2**20, dtype=torch.uint8, device="cuda")

    if not args.no_check:
        doc["correctness"] = correctness(torch, fi, args, gen, workspace, fi_err, xqa_workspace)
        write_json(args.out, doc)

    results = []

    def record(system, variant, ctx, batch, kv_dt, t, **extra):
        br = bytes_read(torch, ctx, batch, kv_dt)
        gbps = br / (t["time_us"] * 1e-6) / 1e9
        r = {"system": system, "variant": variant, "context": ctx, "batch": batch, **t,
             "bytes_read": br, "gbps": gbps, "bw_fraction": gbps / doc["copy_gbps"],
             "kv_dtype": str(kv_dt).replace("torch.", ""), **extra}
        log(f"  {system:<15} {variant:<15} ctx {ctx:>6} b {batch:>3}: {t['time_us']:9.1f} us  {gbps:7.0f} GB/s  {r['bw_fraction']:.2f}")
        results.append(r)

    for ctx in args.contexts:
        for batch in args.batches:
            kv16 = batch * ctx * HKV * D * 2 * 2
            for system in args.systems:
                variants = fi_variants(args, system) if system.startswith("flashinfer") else args.sdpa_variants
                if kv16 > args.max_kv_gb * 1e9:
                    for var in variants:
                        results.append(err_row(system, var, ctx, batch, f"skipped: fp16 K+V {kv16/1e9:.1f} GB > --max-kv-gb {args.max_kv_gb}"))
                    continue
                case = None
                try:
                    if system.startswith("flashinfer"):
                        if fi is None:
                            raise RuntimeError(f"flashinfer import failed: {fi_err}")
                        kv_dtype = torch.float8_e4m3fn if system == "flashinfer_fp8" else torch.float16
                        case = FlashInferCase(torch, fi, args, ctx, batch, kv_dtype, gen, workspace, xqa_workspace)
                        for var in variants:
                            try:
                                w = case.wrapper(var)
                                t = timer(case.run_fn(w))
                                record(system, var, ctx, batch, kv_dtype, t,
                                       backend=getattr(w, "resolved_backend", None), page_size=args.page_size)
                                del w
                            except Exception as e:
                                traceback.print_exc()
                                results.append(err_row(system, var, ctx, batch, e))
                    elif system == "sdpa":
                        case = SdpaCase(torch, ctx, batch, gen)
                        for var in variants:
                            try:
                                t = timer(case.run_fn(var))
                                record(system, var, ctx, batch, torch.float16, t)
                            except Exception as e:
                                msg = str(e).splitlines()[0] if str(e) else ""
                                results.append(err_row(system, var, ctx, batch, f"{type(e).__name__}: {msg}"))
                    else:
                        raise ValueError(f"unknown system {system}")
                except Exception as e:
                    traceback.print_exc()
                    for var in variants:
                        results.append(err_row(system, var, ctx, batch, e))
                finally:
                    del case
                    try:
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                    except Exception as e:  # a sticky CUDA error: later cases will record it too
                        log(f"cleanup after {system} ctx {ctx} b {batch}: {type(e).__name__}: {e}")
            doc["results"] = order_results(list(results))
            write_json(args.out, doc)

    doc["results"] = order_results(results)
    write_json(args.out, doc)
    print_table(doc)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
