"""The serving loop: scheduler + model + attention backend.

``Engine.step()``: admit waiting requests (their blocks reserved under the KV budget), prefill
each (exact attention; its first token sampled), run one decode step for every running request
that already has a token, retire the finished (blocks freed, sequences removed from the
backend). Greedy sampling. ``Engine.steady(...)``: the saturated-batch measurement: ``batch``
sequences whose ``context`` tokens of K/V are synthesised in the backend's cache (no prefill),
then ``steps`` decode steps of the whole batch.
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


class Engine:
    def __init__(self, model, backend, budget_bytes: float, max_batch: int = 256, max_prefill_tokens: int = 1 << 62,
                 max_seqs: Optional[int] = None):
        self.model, self.backend = model, backend
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

    def _decode(self, reqs: List[Request], timers: Optional[Timers] = None) -> torch.Tensor:
        # the last generated token of each request is fed back: position = its cache length - 1
        md = self.backend.begin_step(_Grown(reqs))
        toks = torch.tensor([r.generated[-1] for r in reqs], device=self.device)
        pos = torch.tensor([r.prompt_len + len(r.generated) - 1 for r in reqs], device=self.device)
        logits = self.model.decode(self.backend, md, toks, pos, timers)
        nxt = logits.argmax(-1).tolist()
        for r, t in zip(reqs, nxt):
            r.generated.append(int(t))
        self.decode_steps += 1
        self.decode_tokens += len(reqs)
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
        _sync(self.device)
        for _ in range(warmup):
            self._decode(reqs)
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self._decode(reqs)
            if progress is not None:
                progress.update(1)
        _sync(self.device)
        dt = time.perf_counter() - t0
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
        return {"batch": batch, "context": context, "steps": steps, "elapsed_s": dt,
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
