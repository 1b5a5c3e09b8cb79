"""Continuous batching without torch: the page pool, requests and the scheduler.

A KV budget is a number of device bytes. A backend turns it into ``num_blocks`` blocks of
``block_tokens`` tokens (a block holds those tokens' K and V for every layer and kv head of the
rank, in the backend's format: fp16, fp8, or a kvforge tier), so a compressed format gets more
blocks from the same bytes and the scheduler admits more sequences. The scheduler reserves, at
admission, every block a request will need (prompt + token budget): the budget is never
exceeded and no running request is ever preempted. Requests are admitted first come first
served; a request that does not fit waits (later ones do not overtake it).

vLLM and SGLang allocate blocks lazily and preempt (recompute or swap) when the pool runs dry;
reserving up front is simpler, admits fewer sequences when budgets are long, and is the same
policy for every backend compared here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional


class PagePool:
    """``num_blocks`` blocks, handed out by id. ``contiguous=True`` hands out runs of
    consecutive ids (a dense per-sequence slab, what a plain SDPA cache needs; first fit)."""

    def __init__(self, num_blocks: int, block_tokens: int, contiguous: bool = False):
        if num_blocks < 0 or block_tokens < 1:
            raise ValueError(f"PagePool: num_blocks {num_blocks} must be >= 0 and block_tokens {block_tokens} >= 1")
        self.num_blocks, self.block_tokens, self.contiguous = int(num_blocks), int(block_tokens), contiguous
        self._free = [True] * self.num_blocks
        self._stack = list(range(self.num_blocks - 1, -1, -1))  # lowest id popped first
        self.used = 0
        self.peak = 0

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def alloc(self, n: int) -> Optional[List[int]]:
        """``n`` block ids, or None (nothing taken) when they are not available."""
        if n > self.free_blocks:
            return None
        if self.contiguous:
            start = self._first_fit(n)
            if start is None:
                return None
            ids = list(range(start, start + n))
        else:
            ids = []
            while len(ids) < n:
                i = self._stack.pop()
                if self._free[i]:
                    ids.append(i)
        for i in ids:
            self._free[i] = False
        self.used += n
        self.peak = max(self.peak, self.used)
        return ids

    def _first_fit(self, n: int) -> Optional[int]:
        run = 0
        for i, f in enumerate(self._free):
            run = run + 1 if f else 0
            if run == n:
                return i - n + 1
        return None if n else 0

    def free(self, ids: List[int]) -> None:
        for i in ids:
            if self._free[i]:
                raise ValueError(f"PagePool: block {i} freed twice")
            self._free[i] = True
            if not self.contiguous:
                self._stack.append(i)
        self.used -= len(ids)


@dataclass
class Request:
    """A prompt of ``prompt_len`` tokens (ids in ``prompt`` when the model is real) that
    generates ``max_new`` tokens. ``arrival`` is the engine step at which it may be admitted."""

    rid: int
    prompt_len: int
    max_new: int
    arrival: int = 0
    prompt: Optional[List[int]] = None
    blocks: List[int] = field(default_factory=list)
    generated: List[int] = field(default_factory=list)
    admitted_step: Optional[int] = None
    finished_step: Optional[int] = None
    admitted_s: Optional[float] = None
    first_token_s: Optional[float] = None
    finished_s: Optional[float] = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_len + self.max_new

    @property
    def length(self) -> int:
        """Tokens in the cache now: the prompt and every generated token but the last (which
        is appended when it is fed back)."""
        return self.prompt_len + max(0, len(self.generated) - 1)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new


class Scheduler:
    """FCFS admission under a block budget and a batch cap; ``max_prefill_tokens`` bounds the
    prompt tokens admitted per step (at least one request is admitted when it fits)."""

    def __init__(self, pool: PagePool, max_batch: int, max_prefill_tokens: int = 1 << 62):
        self.pool, self.max_batch, self.max_prefill_tokens = pool, int(max_batch), int(max_prefill_tokens)
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.finished: List[Request] = []
        self.step_no = 0
        self.rejected: List[Request] = []

    def add(self, req: Request) -> None:
        if self.pool.blocks_for(req.total_tokens) > self.pool.num_blocks:
            self.rejected.append(req)  # could never fit: refuse rather than block the queue
            return
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: (r.arrival, r.rid))

    def admit(self) -> List[Request]:
        """Requests admitted this step (blocks reserved), in arrival order."""
        out: List[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(out) < self.max_batch:
            r = self.waiting[0]
            if r.arrival > self.step_no:
                break
            if out and r.prompt_len > budget:
                break
            ids = self.pool.alloc(self.pool.blocks_for(r.total_tokens))
            if ids is None:
                break
            self.waiting.pop(0)
            r.blocks, r.admitted_step = ids, self.step_no
            out.append(r)
            budget -= r.prompt_len
        self.running.extend(out)
        return out

    def retire(self) -> List[Request]:
        """Removes finished requests from the batch and frees their blocks."""
        done = [r for r in self.running if r.done]
        for r in done:
            self.pool.free(r.blocks)
            r.finished_step = self.step_no
            self.finished.append(r)
        self.running = [r for r in self.running if not r.done]
        return done

    def tick(self) -> None:
        self.step_no += 1

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def reserved_tokens(self) -> int:
        return sum(len(r.blocks) for r in self.running) * self.pool.block_tokens


def max_batch_for(num_blocks: int, block_tokens: int, tokens_per_seq: int) -> int:
    """How many sequences of ``tokens_per_seq`` tokens a pool of ``num_blocks`` holds."""
    per = math.ceil(tokens_per_seq / block_tokens)
    return num_blocks // per if per else 0


def mixed_requests(n: int, lengths: List[int], max_new: int, seed: int = 0, arrivals_per_step: float = 0.0) -> List[Request]:
    """``n`` requests whose prompt lengths cycle through a seeded shuffle of ``lengths``;
    with ``arrivals_per_step`` > 0 they arrive at that rate (deterministic spacing),
    else all at step 0."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ln = lengths[rng.randrange(len(lengths))]
        arr = int(i / arrivals_per_step) if arrivals_per_step > 0 else 0
        out.append(Request(rid=i, prompt_len=ln, max_new=max_new, arrival=arr))
    return out


def summarize(reqs: List[Request]) -> Dict[str, float]:
    """Latency statistics of finished requests (seconds): time to first token, time per
    output token after the first, end to end."""
    def pct(v, p):
        if not v:
            return float("nan")
        v = sorted(v)
        k = (len(v) - 1) * p / 100.0
        f, c = math.floor(k), math.ceil(k)
        return v[f] + (v[c] - v[f]) * (k - f)

    ttft = [r.first_token_s - r.admitted_s for r in reqs if r.first_token_s is not None and r.admitted_s is not None]
    tpot = [(r.finished_s - r.first_token_s) / (len(r.generated) - 1) for r in reqs
            if r.finished_s is not None and r.first_token_s is not None and len(r.generated) > 1]
    return {"requests": len(reqs), "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "tpot_p50_ms": pct(tpot, 50) * 1e3, "tpot_p90_ms": pct(tpot, 90) * 1e3}
