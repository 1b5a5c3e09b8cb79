"""Host microseconds per layer of a ``kvforge.hf`` decode step (issue 29), SmolLM2-135M shape.

``--layers`` caches (Hkv 3, gqa 3, head_dim 64, one per attention layer) hold ``batch``
sequences of ``context`` tokens each; every step runs each layer's decode work the way one of
these modes does it, and the host time of the calls is summed with ``time.perf_counter`` (the
GPU is synchronised only after the ``steps`` steps; wall time per step beside it):

- ``split``: ``Cache.append_step`` then ``Cache.decode`` (new output tensors, torch's stream
  looked up by each call): what ``kvforge.hf`` did per layer before ``Cache.step``.
- ``step``: one ``Cache.step`` with the layer's preallocated outputs and the stream handle
  passed in (``kvforge.hf`` now).
- ``attend``: ``KvforgeAttention.attend_batch`` in generate()'s step mode (the Python layer
  around ``Cache.step``: shape checks, slicing, dispatch).
- ``graph``: one captured CUDA graph of every layer's ``graph_launch`` replayed per step, with
  each layer's ``graph_prepare`` and ``graph_commit`` around it (host µs per layer = those two
  calls plus the replay call / layers); a step that fills a tail page runs as ``step``.
- ``prefill``: each layer's sequences removed and a new ``context``-token prompt written per
  row with ``Cache.append_device`` (what ``kvforge.hf``'s prefill does per layer): host µs per
  layer, and the wall time of all layers (the GPU synchronised once per step), so that tiers
  compare on the prompt write alone and a synchronisation inside the call shows as host time.

    python3 benches/serve/hf_host_micro.py [--layers 30] [--batch 1] [--context 2048] [--steps 64] --out hf-host-micro.json
"""

import argparse
import json
import time
from pathlib import Path

import torch

import kvforge
import kvforge.hf
from micro import run_modes, summary

ROOT = str(Path(__file__).resolve().parents[2])
HKV, GQA, D = 3, 3, 64


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="specs/rdkv.toml")
    ap.add_argument("--tier", default="b4")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--modes", default="split,step,attend,graph", help="split, step, attend, graph, prefill")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def build(a, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(a.layers):
        c = kvforge.Cache(a.spec, head_dim=D, num_kv_heads=HKV, gqa=GQA, max_tokens=a.batch * (a.context + a.steps + 512),
                          sequences=a.batch, target=a.tier, root=ROOT, device=dev.index or 0, target_only=True)
        seqs = [c.add_sequence() for _ in range(a.batch)]
        for s in seqs:
            kv = torch.randn(a.context, HKV, D, device=dev, dtype=torch.float16, generator=g)
            c.append_device(s, kv, kv)
        layers.append({"cache": c, "seqs": seqs, "n": a.context, "rows": a.batch, "cap": a.batch, "max_tokens": a.context + a.steps + 512})
    torch.cuda.synchronize()
    return layers


def run(a, mode, dev):
    layers = build(a, dev)
    b = a.batch
    g = torch.Generator(device=dev).manual_seed(1)
    q4 = torch.randn(b, HKV * GQA, 1, D, device=dev, dtype=torch.float16, generator=g)
    kv4 = torch.randn(b, HKV, 1, D, device=dev, dtype=torch.float16, generator=g)
    q, kv = q4[:, :, 0].contiguous(), kv4[:, :, 0].contiguous()
    outs = [(torch.empty(b, HKV * GQA, D, device=dev, dtype=torch.float16), torch.empty(b, HKV * GQA, device=dev, dtype=torch.float32)) for _ in layers]
    stream = torch.cuda.current_stream(dev).cuda_stream
    h = kvforge.hf.KvforgeAttention(spec=a.spec, tier=a.tier, root=ROOT)
    h.layers = dict(enumerate(layers))
    graph = {"g": None, "keys": None, "captures": 0, "cs": torch.cuda.Stream(dev)}
    prompt = torch.randn(a.context, HKV, D, device=dev, dtype=torch.float16, generator=g) if mode == "prefill" else None

    def one_step(times):
        if mode == "prefill":
            for st in layers:
                t = time.perf_counter()
                c = st["cache"]
                for s in st["seqs"]:
                    c.remove_sequence(s)
                st["seqs"] = [c.add_sequence() for _ in range(b)]
                for s in st["seqs"]:
                    c.append_device(s, prompt, prompt)
                times.append(time.perf_counter() - t)
        elif mode == "split":
            for st in layers:
                t = time.perf_counter()
                st["cache"].append_step(st["seqs"], kv, kv)
                st["cache"].decode(q, seqs=st["seqs"])
                times.append(time.perf_counter() - t)
        elif mode == "step":
            for st, (o, l) in zip(layers, outs):
                t = time.perf_counter()
                st["cache"].step(st["seqs"], kv, kv, q, out=o, lse=l, stream=stream)
                times.append(time.perf_counter() - t)
        elif mode == "attend":
            h._step_mode, h._stream = True, stream
            for i in range(len(layers)):
                t = time.perf_counter()
                h.attend_batch(i, q4, kv4, kv4, D ** -0.5)
                times.append(time.perf_counter() - t)
            h._step_mode, h._stream = False, None
        else:
            t = time.perf_counter()
            keys = [st["cache"].graph_prepare(st["seqs"], stream=stream) for st in layers]
            prep = time.perf_counter() - t
            if any(k is None for k in keys):  # a tail fills: a plain step
                t = time.perf_counter()
                for st, (o, l) in zip(layers, outs):
                    st["cache"].step(st["seqs"], kv, kv, q, out=o, lse=l, stream=stream)
                times.append((prep + time.perf_counter() - t) / len(layers))
                graph["plain"] = graph.get("plain", 0) + 1
                return
            if graph["g"] is None or keys != graph["keys"]:
                cg, cs = torch.cuda.CUDAGraph(), graph["cs"]
                cs.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.graph(cg, stream=cs):
                    for st, (o, l) in zip(layers, outs):
                        st["cache"].graph_launch(st["seqs"], kv, kv, q, o, l, cs.cuda_stream)
                graph.update(g=cg, keys=keys, captures=graph["captures"] + 1)
            t = time.perf_counter()
            graph["g"].replay()
            for st in layers:
                st["cache"].graph_commit(st["seqs"], stream=stream)
            times.append((prep + time.perf_counter() - t) / len(layers))

    one_step([])  # warm-up: kernels loaded, resident plans built, the first capture
    torch.cuda.synchronize()
    times = []
    t_wall = time.perf_counter()
    for _ in range(a.steps):
        one_step(times)
    t_sync = time.perf_counter()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t_wall
    for st in layers:
        st["cache"].synchronize()
    row = {"mode": mode, "layers": a.layers, "batch": b, "context": a.context, "steps": a.steps, "tier": a.tier, **summary(times, 1e6, "host_us_per_layer"),
           "host_loop_ms_per_step": 1e3 * (t_sync - t_wall) / a.steps, "wall_ms_per_step": 1e3 * wall / a.steps,
           "captures": graph["captures"] if mode == "graph" else None, "plain_steps": graph.get("plain", 0) if mode == "graph" else None}
    print(json.dumps(row), flush=True)
    del layers, h
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    a = parse(argv)
    dev = torch.device("cuda")
    header = {"device": torch.cuda.get_device_name(dev), "kvforge": getattr(kvforge, "__version__", None), "torch": torch.__version__}
    return run_modes(a, a.modes.split(","), lambda mode: run(a, mode, dev), header)


if __name__ == "__main__":
    main()
