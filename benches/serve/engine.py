"""The serving loop: scheduler + model + attention backend.

``Engine.step()``: admit waiting requests (their blocks reserved under the KV budget), prefill
each (exact attention; its first token sampled), run one decode step for every running request
that already has a token, retire the finished (blocks freed, sequences removed from the
backend). Greedy sampling. ``Engine.steady(...)``: the saturated-batch measurement: ``batch``
sequences whose ``context`` tokens of K/V are synthesised in the backend's cache (no prefill),
then ``steps`` decode steps of the whole batch.

``Engine(..., cuda_graph=True)`` (``run.py --cuda-graph``): ``steady`` (and ``tpot``, its batch
1) decode a fixed batch, so the whole model's decode step — embedding, every layer with the
backend's cache write and attention, the logits and the argmax — is captured once with
``torch.cuda.CUDAGraph`` and replayed (:class:`StepGraph`), for every backend that can run in
a graph (``Backend.graph_capable``: FlashInfer and kvforge; SDPA's per-sequence loop has
shapes that change every step and runs eagerly). Per step the host runs the backend's
``graph_prepare`` (metadata into the captured buffers), one replay and ``graph_commit``; a step
the backend cannot replay (kvforge: one that fills a tail page, once per 64 tokens) runs
eagerly, and a changed key captures again. Captures happen inside the timed steps where a key
changes there; their host time is reported apart (``graph_capture_s``). Continuous batching
(``loop``) changes its batch every few steps and stays eager.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from batching import PagePool, Request, Scheduler


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timers:
    """Wall time of the cache writes and of the attention inside decode steps, with a device
    synchronisation around each: only for breakdown steps, never the timed ones."""

    def __init__(self, device):
        self.device, self.write_s, self.attn_s = device, 0.0, 0.0

    def decode(self, backend, layer, md, q, k, v):
        _sync(self.device)
        t0 = time.perf_counter()
        backend.write_step(layer, md, k, v)
        _sync(self.device)
        t1 = time.perf_counter()
        out = backend.attend(layer, md, q)
        _sync(self.device)
        self.write_s += t1 - t0
        self.attn_s += time.perf_counter() - t1
        return out


class StepGraph:
    """The model's decode step of one fixed batch as a CUDA graph: static token and position
    inputs (copied in before each replay) and static logits. Captured on a side stream after
    one eager step ran there (torch's advice: lazily made per-stream state such as cuBLAS
    workspaces exists before a capture), again whenever the backend's key changes."""

    def __init__(self, model, backend, batch: int, device):
        self.model, self.backend, self.batch = model, backend, batch
        self.toks = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.logits = None
        self.stream = torch.cuda.Stream(device)
        self.pool = None
        self.graph = None
        self.key = None
        self.warm = False
        self.captures = 0
        self.capture_s = 0.0
        self.eager_steps = 0
        self.replays = 0

    def warm_step(self, grown, toks, pos):
        """One eager step on the capture stream (its metadata made there too: kvforge joins
        the stream current at ``begin_step``); returns its logits."""
        cur = torch.cuda.current_stream()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            md = self.backend.begin_step(grown)
            logits = self.model.decode(self.backend, md, toks, pos)
        cur.wait_stream(self.stream)
        self.warm = True
        self.eager_steps += 1
        return logits

    def replay(self, key, toks, pos):
        """The captured step on ``toks``/``pos`` (capturing it first where ``key`` differs from
        the captured one); returns the static logits."""
        self.toks.copy_(toks)
        self.pos.copy_(pos)
        if self.graph is None or key != self.key:
            t0 = time.perf_counter()
            g = torch.cuda.CUDAGraph()
            cur = torch.cuda.current_stream()
            self.stream.wait_stream(cur)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.graph = None  # the old graph's memory goes back to the pool first
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                sid = self.stream.cuda_stream
                be = self.backend

                def attend(layer, q, k, v):
                    return be.graph_decode(layer, q, k, v, sid)

                self.logits = self.model.decode_with(attend, self.toks, self.pos)
            cur.wait_stream(self.stream)
            self.graph, self.key = g, key
            self.captures += 1
            self.capture_s += time.perf_counter() - t0
        self.graph.replay()
        self.replays += 1
        return self.logits

    def stats(self):
        return {"graph_captures": self.captures, "graph_capture_s": self.capture_s, "graph_eager_steps": self.eager_steps,
                "graph_replays": self.replays}


class Engine:
    def __init__(self, model, backend, budget_bytes: float, max_batch: int = 256, max_prefill_tokens: int = 1 << 62,
                 max_seqs: Optional[int] = None, cuda_graph: bool = False):
        self.model, self.backend = model, backend
        self.cuda_graph = bool(cuda_graph)
        self.graph: Optional[StepGraph] = None
        self.graph_error: Optional[str] = None
        self.device = model.device
        self.max_seqs = max_seqs or max_batch
        bt, nb = backend.capacity(budget_bytes, self.max_seqs)
        self.budget_bytes = budget_bytes
        self.pool = PagePool(nb, bt, contiguous=backend.contiguous)
        backend.allocate(nb, self.max_seqs)
        self.sched = Scheduler(self.pool, max_batch, max_prefill_tokens)
        self.vocab = model.cfg.vocab
        self.decode_steps = 0
        self.decode_tokens = 0
        self.prefill_tokens = 0

    def kv_bytes_reserved(self) -> float:
        """Block bytes reserved by running requests (never above the budget)."""
        return self.pool.used * self.backend.block_bytes()

    def add(self, reqs: List[Request]) -> None:
        for r in reqs:
            self.sched.add(r)

    def _prompt_tokens(self, r: Request) -> torch.Tensor:
        if r.prompt is None:  # random prompt, reproducible per request
            g = torch.Generator().manual_seed(1000 + r.rid)
            r.prompt = torch.randint(0, self.vocab, (r.prompt_len,), generator=g).tolist()
        return torch.tensor(r.prompt, device=self.device)

    def step(self) -> Dict[str, int]:
        s = self.sched
        new = s.admit()
        now = time.perf_counter()
        for r in new:
            r.admitted_s = now
            self.backend.new_seq(r)
            logits = self.model.prefill(self.backend, r, self._prompt_tokens(r))
            r.generated.append(int(logits.argmax()))
            r.first_token_s = time.perf_counter()
            self.prefill_tokens += r.prompt_len
        dec = [r for r in s.running if r not in new and not r.done]
        if dec:
            self._decode(dec)
        for r in s.running:
            if r.done and r.finished_s is None:
                r.finished_s = time.perf_counter()
        for r in s.retire():
            self.backend.free_seq(r)
        s.tick()
        return {"admitted": len(new), "decoded": len(dec), "running": len(s.running), "waiting": len(s.waiting)}

    def graph_ready(self) -> bool:
        """Whether decode steps go through a :class:`StepGraph` (``cuda_graph`` asked, a CUDA
        device, a backend that can be captured, no failure so far)."""
        return self.cuda_graph and self.graph_error is None and self.device.type == "cuda" and self.backend.graph_capable()

    def _decode(self, reqs: List[Request], timers: Optional[Timers] = None, graph: bool = False) -> torch.Tensor:
        # the last generated token of each request is fed back: position = its cache length - 1
        grown = _Grown(reqs)
        toks = torch.tensor([r.generated[-1] for r in reqs], device=self.device)
        pos = torch.tensor([r.prompt_len + len(r.generated) - 1 for r in reqs], device=self.device)
        logits = None
        if graph and timers is None:
            logits = self._graph_step(reqs, grown, toks, pos)
        if logits is None:
            md = self.backend.begin_step(grown)
            logits = self.model.decode(self.backend, md, toks, pos, timers)
        nxt = logits.argmax(-1).tolist()
        for r, t in zip(reqs, nxt):
            r.generated.append(int(t))
        self.decode_steps += 1
        self.decode_tokens += len(reqs)
        return logits

    def _graph_step(self, reqs, grown, toks, pos) -> Optional[torch.Tensor]:
        """One decode step through the step graph; None where it runs eagerly (the caller
        then runs it): the backend refused the step or the graph failed (the reason kept in
        ``graph_error``, later steps eager)."""
        if self.graph_error is not None:
            return None
        g = self.graph
        if g is None or g.batch != len(reqs):
            g = self.graph = StepGraph(self.model, self.backend, len(reqs), self.device)
        if not g.warm:
            return g.warm_step(grown, toks, pos)
        try:
            key = self.backend.graph_prepare(grown)
            if key is None:
                g.eager_steps += 1
                return None
            logits = g.replay(key, toks, pos)
        except Exception as e:  # noqa: BLE001 - any reason the step cannot run in a graph
            self.graph_error = f"{type(e).__name__}: {e}"[:500]
            return None
        self.backend.graph_commit(grown)
        return logits

    def run(self, progress=None, max_steps: int = 1 << 30) -> None:
        n = 0
        while not self.sched.idle and n < max_steps:
            info = self.step()
            n += 1
            if progress is not None:
                progress.update(info["decoded"] + info["admitted"])
                progress.set_postfix(running=info["running"], waiting=info["waiting"], kv=f"{self.pool.used}/{self.pool.num_blocks}")

    # steady state -----------------------------------------------------------------------
    def steady(self, batch: int, context: int, steps: int, warmup: int = 3, breakdown: int = 2, progress=None, seed: int = 0) -> Dict:
        """``batch`` sequences at ``context`` cached tokens (synthetic K/V), ``warmup`` +
        ``steps`` timed decode steps (+ ``breakdown`` steps with synchronised attention timing).
        Returns tokens/s, time per output token and the attention share."""
        total = warmup + steps + breakdown
        reqs = [Request(rid=i, prompt_len=context, max_new=total + 1, prompt=[]) for i in range(batch)]
        for r in reqs:
            ids = self.pool.alloc(self.pool.blocks_for(r.total_tokens))
            if ids is None:
                raise RuntimeError(f"steady: {batch} x {context + total + 1} tokens do not fit {self.pool.num_blocks} blocks of {self.pool.block_tokens}")
            r.blocks = ids
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.backend.fill_synthetic(reqs, context, gen)
        g = torch.Generator().manual_seed(seed)
        for r in reqs:
            r.generated.append(int(torch.randint(0, self.vocab, (1,), generator=g)))
        graph = self.graph_ready()
        _sync(self.device)
        for _ in range(warmup):
            self._decode(reqs, graph=graph)
        _sync(self.device)
        g0 = self.graph.stats() if graph and self.graph is not None else None
        t0 = time.perf_counter()
        for _ in range(steps):
            self._decode(reqs, graph=graph)
            if progress is not None:
                progress.update(1)
        _sync(self.device)
        dt = time.perf_counter() - t0
        gstats: Dict = {"cuda_graph": graph and self.graph_error is None, "cuda_graph_asked": self.cuda_graph}
        if graph and self.graph is not None:
            g1 = self.graph.stats()
            # the timed steps' share (warm-up steps captured the first graph)
            gstats.update({k: g1[k] - (g0 or {}).get(k, 0) for k in g1})
            gstats["tokens_per_s_excl_capture"] = batch * steps / max(1e-12, dt - gstats["graph_capture_s"])
        if self.graph_error is not None:
            gstats["cuda_graph_error"] = self.graph_error
        if hasattr(self.backend, "synchronize"):
            self.backend.synchronize()  # faults flagged asynchronously (kvforge) raise here
        timers = Timers(self.device)
        _sync(self.device)
        tb = time.perf_counter()
        for _ in range(breakdown):
            self._decode(reqs, timers)
        _sync(self.device)
        tbd = time.perf_counter() - tb
        for r in reqs:
            self.pool.free(r.blocks)
            self.backend.free_seq(r)
        self.graph = None  # its static buffers and memory pool: this batch's only
        return {**gstats, "batch": batch, "context": context, "steps": steps, "elapsed_s": dt,
                "tokens_per_s": batch * steps / dt, "step_ms": dt / steps * 1e3,
                "attn_share": (timers.attn_s / tbd) if breakdown else None,
                "attn_ms_per_step": (timers.attn_s / breakdown * 1e3) if breakdown else None,
                "kv_write_ms_per_step": (timers.write_s / breakdown * 1e3) if breakdown else None,
                "breakdown_step_ms": (tbd / breakdown * 1e3) if breakdown else None,
                "kv_bytes_reserved": len(reqs) * self.pool.blocks_for(context + total + 1) * self.backend.block_bytes()}


class _Grown(list):
    """The decode batch as the backends see it: each request's cache length already counts
    the token being fed back (its K/V is written in this step)."""

    def __init__(self, reqs):
        super().__init__(_View(r) for r in reqs)


class _View:
    __slots__ = ("r",)

    def __init__(self, r):
        self.r = r

    @property
    def length(self):
        return self.r.prompt_len + len(self.r.generated)

    def __getattr__(self, k):
        return getattr(self.r, k)
