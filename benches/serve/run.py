#!/usr/bin/env python3
"""End-to-end serving measurements: tokens/s per attention backend under one KV budget.

Modes (``--mode``):

* ``steady``: for each context and backend, the largest batch the KV budget admits (capped by
  ``--max-batch``, or ``--batch``) of sequences holding ``context`` tokens of synthetic K/V
  (no prefill), then ``--steps`` decode steps of the whole model: tokens/s, ms per step, the
  attention share of a step (from ``--breakdown`` synchronised steps).
* ``tpot``: ``steady`` at batch 1: time per output token.

``--cuda-graph`` (steady and tpot; default off): every backend that can be captured
(FlashInfer, kvforge) replays the whole model's decode step from one CUDA graph
(engine.StepGraph); SDPA runs eagerly. Each row records ``cuda_graph`` (whether its steps ran
in a graph), the captures and eager steps inside the timed window and
``tokens_per_s_excl_capture``.
* ``loop``: continuous batching: ``--requests`` prompts with lengths drawn from
  ``--prompt-lens`` arrive (``--arrival-rate`` per step, 0: all at once), are prefilled
  (exact attention), decode ``--max-new`` tokens and leave; tokens/s over the run and
  TTFT / TPOT percentiles.
* ``quality`` (``--model smollm2``): greedy continuations of Pride and Prejudice prompts
  through the loop with each backend against ``sdpa`` (fp16, exact), and ``sdpa`` against
  transformers' own ``generate``: the fraction of positions equal and the first mismatch.

Models: ``llama8b`` (Llama-3-8B shape, random fp16 weights, ``--layers`` layers), ``tiny``
(CPU tests), ``smollm2`` (real weights from the GGUF under ``--model-dir``).

Tensor parallel: run under ``torchrun --nproc-per-node 2``; each rank holds half the heads
and the budget is per GPU. Rank 0 writes the JSON.

Backends: ``sdpa``, ``flashinfer``, ``flashinfer_fp8``, ``kvforge:<tier>`` (``fp16``
(specs/baseline.toml), ``b8``/``b4``/``b2`` (specs/rdkv.toml), ``r4``/``r3``/``k3v2``/``r2``
(specs/rotated.toml)) or ``kvforge:<spec>:<tier>``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from backends import make_backend  # noqa: E402
from engine import Engine  # noqa: E402
from model import Llama, LlamaConfig, tp_info  # noqa: E402
from batching import max_batch_for, mixed_requests, summarize, Request  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["steady", "tpot", "loop", "quality"], default="steady")
    ap.add_argument("--model", choices=["llama8b", "tiny", "smollm2"], default="llama8b")
    ap.add_argument("--model-dir", default="/root/m")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--backends", default="sdpa,flashinfer,flashinfer_fp8,kvforge:fp16,kvforge:b4,kvforge:r3")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--budget-gb", type=float, default=40.0, help="KV budget per GPU, GB (1e9 bytes)")
    ap.add_argument("--max-batch", type=int, default=int(os.environ.get("SERVE_MAX_BATCH", "256")))
    ap.add_argument("--batch", type=int, default=0, help="fixed batch (0: the largest the budget admits)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--breakdown", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-lens", default="1024,2048,4096")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--arrival-rate", type=float, default=0.0)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--fi-variant", choices=["tc", "cc"], default="tc")
    ap.add_argument("--cuda-graph", action="store_true", help="steady / tpot: replay each decode step of the whole model from a CUDA graph "
                    "(FlashInfer and kvforge backends; SDPA stays eager)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    a.backends = [b for b in a.backends.split(",") if b]
    a.contexts = [int(c) for c in a.contexts.split(",") if c]
    a.prompt_lens = [int(c) for c in a.prompt_lens.split(",") if c]
    return a


def log(*x):
    if tp_info()[0] == 0:
        print(*x, flush=True)


def progress_bar(total, desc, disable):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, disable=disable or tp_info()[0] != 0, mininterval=2.0, file=sys.stderr)


def init_dist():
    """torchrun's environment → the process group (NCCL on GPUs, gloo on CPU) and this
    rank's device; None when not launched by torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            return torch.device("cuda", local)
        dist.init_process_group("gloo")
        return torch.device("cpu")
    return None


def build_model(a, device):
    if a.model == "tiny":
        return Llama(LlamaConfig.tiny(a.layers), device, seed=a.seed), None, None
    if a.model == "llama8b":
        return Llama(LlamaConfig.llama3_8b(a.layers), device, seed=a.seed), None, None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = Path(a.model_dir)
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16).to(device).eval()
    return Llama.from_hf(hf, device), tok, hf


def engine_for(a, model, name, device, max_seqs):
    c = model.cfg
    be = make_backend(name, c.layers, model.hq, model.hkv, c.d, device, root=str(ROOT), fi_tensor_cores=a.fi_variant == "tc")
    return Engine(model, be, a.budget_gb * 1e9, max_batch=max_seqs, max_prefill_tokens=a.max_prefill_tokens, max_seqs=max_seqs,
                  cuda_graph=a.cuda_graph and a.mode in ("steady", "tpot"))


def free_engine(eng):
    """Drops a backend's caches and returns their memory to the driver: kvforge's freed pages
    sit in the device's memory pool (where PyTorch cannot allocate) until ``kvforge.empty_cache``."""
    kv = eng is not None and eng.backend.name.startswith("kvforge")
    if eng is not None:
        eng.backend.__dict__.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if kv:
            import kvforge

            if hasattr(kvforge, "empty_cache"):
                kvforge.empty_cache(torch.cuda.current_device())
        torch.cuda.empty_cache()


def run_steady(a, model, device, doc, batch1=False):
    rows = doc["results"]
    for ctx in a.contexts:
        for name in a.backends:
            eng = None
            row = {"mode": "tpot" if batch1 else "steady", "backend": name, "context": ctx}
            try:
                total = ctx + a.warmup + a.steps + a.breakdown + 1
                be = make_backend(name, model.cfg.layers, model.hq, model.hkv, model.cfg.d, device, root=str(ROOT), fi_tensor_cores=a.fi_variant == "tc")
                if batch1 or a.batch:
                    b = 1 if batch1 else a.batch
                else:
                    # largest batch whose blocks and fixed bytes fit the budget
                    b = 0
                    for cand in range(a.max_batch, 0, -1):
                        bt, nb = be.capacity(a.budget_gb * 1e9, cand)
                        if max_batch_for(nb, bt, total) >= cand:
                            b = cand
                            break
                if b == 0:
                    raise RuntimeError(f"not one sequence of {total} tokens fits {a.budget_gb} GB")
                del be
                eng = engine_for(a, model, name, device, b)
                bar = progress_bar(a.steps, f"{name} ctx {ctx} b {b}", a.no_progress)
                r = eng.steady(b, ctx, a.steps, a.warmup, a.breakdown, progress=bar, seed=a.seed)
                if bar is not None:
                    bar.close()
                row.update(r)
                row.update(eng.backend.describe())
                row["kv_budget_bytes"] = a.budget_gb * 1e9
                row["kv_blocks"] = eng.pool.num_blocks
                row["tpot_ms"] = r["step_ms"]
                graph = ""
                if r.get("cuda_graph"):
                    graph = f"  graph: {r.get('graph_captures', 0)} captures ({r.get('graph_capture_s', 0) * 1e3:.1f} ms), {r.get('graph_eager_steps', 0)} eager steps"
                elif r.get("cuda_graph_asked"):
                    graph = "  graph: not used" + (f" ({r['cuda_graph_error']})" if r.get("cuda_graph_error") else "")
                log(f"{row['mode']:<6} {name:<18} ctx {ctx:>6} b {b:>4}: {r['tokens_per_s']:9.1f} tok/s  {r['step_ms']:8.2f} ms/step  "
                    f"attn {r['attn_ms_per_step'] or 0:7.2f} ms  kv write {r['kv_write_ms_per_step'] or 0:7.2f} ms (synchronised steps)  "
                    f"{row['bytes_per_token']:.0f} B/token{graph}")
            except Exception as e:
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"[:4000]
                log(f"{row['mode']:<6} {name:<18} ctx {ctx:>6}: ERROR {row['error'][:200]}")
            rows.append(row)
            free_engine(eng)
            write(a, doc)


def run_loop(a, model, device, doc):
    for name in a.backends:
        eng = None
        row = {"mode": "loop", "backend": name, "prompt_lens": a.prompt_lens, "max_new": a.max_new, "requests": a.requests}
        try:
            if name.endswith("+nowrite"):
                raise ValueError("+nowrite backends skip the cache writes: steady / tpot modes only")
            eng = engine_for(a, model, name, device, a.max_batch)
            reqs = mixed_requests(a.requests, a.prompt_lens, a.max_new, seed=a.seed, arrivals_per_step=a.arrival_rate)
            eng.add(reqs)
            bar = progress_bar(sum(r.max_new for r in reqs), f"loop {name}", a.no_progress)
            t0 = time.perf_counter()
            peak_running = 0
            while not eng.sched.idle:
                info = eng.step()
                peak_running = max(peak_running, info["running"])
                if bar is not None:
                    bar.update(info["decoded"] + info["admitted"])
                    bar.set_postfix(running=info["running"], waiting=info["waiting"], kv=f"{eng.pool.used}/{eng.pool.num_blocks}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if bar is not None:
                bar.close()
            gen = sum(len(r.generated) for r in eng.sched.finished)
            row.update({"elapsed_s": dt, "generated": gen, "tokens_per_s": gen / dt, "prefill_tokens": eng.prefill_tokens,
                        "steps": eng.sched.step_no, "peak_blocks": eng.pool.peak, "kv_blocks": eng.pool.num_blocks,
                        "peak_running": peak_running, "rejected": len(eng.sched.rejected), **summarize(eng.sched.finished),
                        **eng.backend.describe()})
            log(f"loop   {name:<18}: {row['tokens_per_s']:9.1f} tok/s over {dt:.1f} s, peak blocks {eng.pool.peak}/{eng.pool.num_blocks}, "
                f"ttft p50 {row['ttft_p50_s']:.3f} s, tpot p50 {row['tpot_p50_ms']:.1f} ms")
        except Exception as e:
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}"[:4000]
        doc["results"].append(row)
        free_engine(eng)
        write(a, doc)


def run_quality(a, model, tok, hf, device, doc):
    """Greedy continuations through the loop, every backend against ``sdpa``; ``sdpa`` against
    transformers' ``generate`` on the same prompts."""
    text = (ROOT / "data" / "austen" / "prideprejudice.txt")
    if not text.exists():
        text = Path("/work/main/data/austen/prideprejudice.txt")
    ids = tok(text.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    prompts = [ids[i * 4096:i * 4096 + n] for i, n in enumerate(a.prompt_lens)]
    outs = {}
    for name in ["sdpa"] + [b for b in a.backends if b != "sdpa"]:
        eng = None
        try:
            eng = engine_for(a, model, name, device, len(prompts))
            reqs = [Request(rid=i, prompt_len=len(p), max_new=a.max_new, prompt=list(p)) for i, p in enumerate(prompts)]
            eng.add(reqs)
            eng.run()
            outs[name] = [r.generated for r in sorted(eng.sched.finished, key=lambda r: r.rid)]
        except Exception as e:
            traceback.print_exc()
            doc["results"].append({"mode": "quality", "backend": name, "error": f"{type(e).__name__}: {e}"[:4000]})
        free_engine(eng)
    ref = outs.get("sdpa")
    if hf is not None and ref is not None:
        with torch.inference_mode():
            g = [hf.generate(torch.tensor([p], device=device), max_new_tokens=a.max_new, do_sample=False)[0, len(p):].tolist() for p in prompts]
        outs["transformers"] = g
    for name, o in outs.items():
        if ref is None:
            break
        base = outs["transformers"] if name == "sdpa" and "transformers" in outs else ref
        if name == "transformers":
            continue
        eq = [sum(x == y for x, y in zip(u, w)) / max(1, len(w)) for u, w in zip(o, base)]
        first = [next((i for i, (x, y) in enumerate(zip(u, w)) if x != y), len(w)) for u, w in zip(o, base)]
        row = {"mode": "quality", "backend": name, "against": "transformers" if base is not ref else "sdpa", "prompt_lens": [len(p) for p in prompts],
               "max_new": a.max_new, "equal_fraction": eq, "first_mismatch": first, "text": [tok.decode(u[:32]) for u in o]}
        log(f"quality {name:<18} vs {row['against']:<12}: equal {['%.2f' % x for x in eq]}, first mismatch {first}")
        doc["results"].append(row)
    write(a, doc)


def write(a, doc):
    if a.out and tp_info()[0] == 0:
        p = Path(a.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, p)


def main(argv=None):
    a = parse_args(argv)
    device = init_dist()
    if device is None:
        device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world, _ = tp_info()
    model, tok, hf = build_model(a, device)
    c = model.cfg
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "tp": world, "model": a.model, "args": {k: v for k, v in vars(a).items()},
           "config": {"layers": c.layers, "hq": c.hq, "hkv": c.hkv, "d": c.d, "hidden": c.hidden, "inter": c.inter, "vocab": c.vocab},
           "results": []}
    log(f"{doc['device']} tp {world}, model {a.model} ({c.layers} layers, Hq {c.hq} Hkv {c.hkv} D {c.d}), budget {a.budget_gb} GB per GPU")
    if a.mode == "steady":
        run_steady(a, model, device, doc)
    elif a.mode == "tpot":
        run_steady(a, model, device, doc, batch1=True)
    elif a.mode == "loop":
        run_loop(a, model, device, doc)
    else:
        run_quality(a, model, tok, hf, device, doc)
    write(a, doc)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
