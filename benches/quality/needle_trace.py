#!/usr/bin/env python3
"""CPU simulation of RDKV on the rotated ladder (issue 26): the needle test of budget.py and a
trace of what the answer reads.

What is simulated (as ``budget.py --rotated F`` runs it on the GPU): an exact prefill of the
prompt (fp32 attention on the model's own K/V, ``kvforge.hf.exact_attention``, which also gives
the token masses the controller weighs), then per layer and kv head RDKV's page allocation
(a port of crates/kvforge-control/src/rdkv.rs + knapsack.rs + plan.rs: pages of 64 tokens, the
page weight the summed token mass, distortion ``w·(ε_K(b_K)+ε_V(b_V))/2``, the drop tier
``max(w·ε(0), w·ε(r2))``, resident page bytes from ``kvforge list`` (d = 64), the budget split
equally over kv heads, each head's lower convex hulls walked greedily by price until the budget
is met; sinks and recent pages and the partial tail page stay r16), then greedy decoding of the
answer on the cache as the controller leaves it: every page's K/V replaced by its tier's
simulated reconstruction (``kvq.TierSim``), dropped pages masked out, the decoded tokens fp16
in the rotated basis. The model runs in fp32 on the CPU (the GPU runs fp16).

Settings (``--settings``, comma-separated; terms joined by ``+``):
  fp16            no controller (every page r16)
  whole           weights = the whole prompt's attention column sums (budget.py's default)
  obs=N | obs=F   weights from the prompt's last N queries (F < 1: a fraction of the prompt)
  mix=W           with obs: W × window + (1 − W) × scaled whole-prompt sums (observe_weight)
  keep=K          with obs: the K positions the window attends most get the head's whole mass
  pool=P          SnapKV pooling: the window mass averaged over P neighbouring tokens first
  keeppage=K      like keep, but every token of the pages holding the top-K positions
  union=K         like keeppage, the pages of any kv head's top-K positions in every head of the layer
  gunion=K        like union, over every layer: the pages of any (layer, head)'s top-K window positions
                  get the head's whole mass in every head of every layer
  gpin=K          those pages pinned at r16 (protected) in every head of every layer
  radius=R        with gunion/gpin: the pages of every token within R positions of a top position
  nodrop          a dropped token costs 1e6 (floor r2)
  budget=F        byte budget (fraction of fp16; default --budget)
  recent=N        protected recent tokens (default --recent)
  pin=needle | pin=needle1 | pin=question   needle pages (±1 page) / the question's pages at r16
  force=needle:TIER  the needle's pages forced to TIER after allocation (an intervention)

    python benches/quality/needle_trace.py --depths 0.2 --settings fp16,whole,obs=64
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402
from kvq import log  # noqa: E402

SPEC = kvq.ROOT / "specs" / "rotated.toml"
TIERS = ["tail", "r16", "r4", "r3", "k3v2", "r2", "drop"]  # tier ids as the spec numbers them
BITS = {"r16": (16, 16), "r4": (4, 4), "r3": (3, 3), "k3v2": (3, 2), "r2": (2, 2), "drop": (0, 0)}
# Resident page bytes at head_dim 64 (`target/release/kvforge list`, specs/rotated.toml).
PAGE_BYTES = {"tail": 16512.0, "r16": 16512.0, "r4": 4480.0, "r3": 3456.0, "k3v2": 2944.0, "r2": 2432.0, "drop": 0.0}
PAGE = 64
SHORT = {"r16": "F", "r4": "4", "r3": "3", "k3v2": "k", "r2": "2", "drop": "x"}
CALIB_DEFAULT = kvq.ROOT / "benches" / "results" / "budget-rotated-r16-needle4k-h200-2026-11-29.json"
DEFAULT_SETTINGS = "fp16,whole,obs=64,obs=16,obs=64+keep=16,obs=64+nodrop"


# ------------------------------------------------------------------------------------------
# RDKV's page allocation (Python port)

def hull_moves(cost: list, dist: list) -> list:
    """Lower convex hull of one page's choices from the least distortion (ties: the most
    expensive) towards the cheapest: [(rho, saved bytes, from index, to index)]."""
    n = len(cost)
    order = sorted(range(n), key=lambda i: (dist[i], -cost[i]))
    cur = order[0]
    moves = []
    while True:
        best, br = None, None
        for j in range(n):
            if cost[j] < cost[cur]:
                r = (dist[j] - dist[cur]) / (cost[cur] - cost[j])
                if br is None or r < br - 1e-300 or (abs(r - br) <= 1e-300 and cost[j] < cost[best]):
                    best, br = j, r
        if best is None:
            return moves
        moves.append((br, cost[cur] - cost[best], cur, best))
        cur = best


def page_eps(eps_k: dict, eps_v: dict, drop_eps: float) -> dict:
    """ε per tier: (ε_K(b_K) + ε_V(b_V)) / 2 (rdkv.rs ``with_tables``)."""
    k = {int(b): float(e) for b, e in eps_k.items()}
    v = {int(b): float(e) for b, e in eps_v.items()}
    k[0] = v[0] = drop_eps
    return {t: 0.5 * (k[bk] + v[bv]) for t, (bk, bv) in BITS.items()}


def allocate(mass: np.ndarray, eps: dict, budget_per_token: float, sinks: int, recent: int, pins=()) -> tuple:
    """RDKV on one layer: ``mass`` [Hkv, P] token masses. Returns (tiers [Hkv, pages] as tier
    names, info). Full pages start in r16; the partial tail page is fixed (tail tier)."""
    hkv, p = mass.shape
    full = p // PAGE
    ladder = ["r16", "r4", "r3", "k3v2", "r2", "drop"]
    last_live = eps["r2"]
    budget = budget_per_token * p * hkv
    tail_cost = PAGE_BYTES["tail"] if p % PAGE else 0.0
    heads = []
    for h in range(hkv):
        w = mass[h, :full * PAGE].reshape(full, PAGE).sum(1) if full else np.zeros(0)
        fixed, items = tail_cost, []
        for i in range(full):
            first, last = i * PAGE, i * PAGE + PAGE - 1
            protected = first < sinks or (recent > 0 and last + recent >= p) or i in pins
            if protected:
                fixed += PAGE_BYTES["r16"]
                continue
            cost = [PAGE_BYTES[t] for t in ladder]
            dist = [w[i] * eps[t] if t != "drop" else max(w[i] * eps["drop"], w[i] * last_live) for t in ladder]
            items.append((i, cost, dist))
        heads.append((w, fixed, items))
    min_cost = [f for _, f, _ in heads]
    shares = head_shares(min_cost, budget)
    tiers = np.array([["r16"] * full for _ in range(hkv)], dtype=object).reshape(hkv, full)
    info = {"budget": budget, "feasible": True, "lambda": []}
    for h, (w, fixed, items) in enumerate(heads):
        cost = fixed + sum(c[0] for _, c, _ in items)
        moves = []
        for idx, (i, c, d) in enumerate(items):
            for step, (rho, save, a, b) in enumerate(hull_moves(c, d)):
                moves.append((rho, idx, step, save, b))
        moves.sort(key=lambda m: (m[0], m[1], m[2]))
        pick = [0] * len(items)
        lam = 0.0
        for rho, idx, step, save, b in moves:
            if cost <= shares[h]:
                break
            cost -= save
            pick[idx] = b
            lam = rho
        if cost > shares[h]:
            info["feasible"] = False
        info["lambda"].append(lam)
        for (i, _, _), b in zip(items, pick):
            tiers[h, i] = ladder[b]
    return tiers, info


def head_shares(min_cost: list, budget: float) -> list:
    """rdkv.rs ``head_shares``: equal shares, heads that cannot live on one get their minimum."""
    n = len(min_cost)
    pinned = [False] * n
    while True:
        free = n - sum(pinned)
        left = budget - sum(m for m, p in zip(min_cost, pinned) if p)
        share = left / free if free else 0.0
        changed = False
        for h in range(n):
            if not pinned[h] and min_cost[h] > share:
                pinned[h] = changed = True
        if not changed:
            return [min_cost[h] if pinned[h] else share for h in range(n)]


# ------------------------------------------------------------------------------------------
# Prefill capture and the simulated cache

class Prefill:
    """Exact prefill (kvforge.hf.exact_attention, fp32): keeps every layer's K/V, the last
    ``keep_q`` queries (for observation windows) and the whole prompt's column sums."""

    def __init__(self, keep_q: int):
        self.keep_q, self.k, self.v, self.q, self.whole = keep_q, {}, {}, {}, {}
        self.scaling = None

    def reset(self):
        pass

    def attend(self, layer, q, k, v, scaling):
        out, mass = kvq.hf.exact_attention(q, k, v, scaling, column_sums=True)
        self.k[layer], self.v[layer] = k.detach().float(), v.detach().float()
        self.q[layer] = q[:, -self.keep_q:].detach().float()
        self.whole[layer] = mass.numpy()
        self.scaling = scaling
        return out


class Recon:
    """Every tier's reconstruction of one prefill's K/V ([6, Hkv, P, D] per layer: r16 .. r2)."""

    def __init__(self, pre: Prefill):
        sims = {t: kvq.TierSim(SPEC, t) for t in ("r16", "r4", "r3", "k3v2", "r2")}
        self.k, self.v = {}, {}
        for layer in pre.k:
            self.k[layer] = torch.stack([sims[t].keys(pre.k[layer]) for t in sims] + [torch.zeros_like(pre.k[layer])])
            self.v[layer] = torch.stack([sims[t].values(pre.v[layer]) for t in sims] + [torch.zeros_like(pre.v[layer])])
        self.tail = sims["r16"]


LIVE = {"r16": 0, "r4": 1, "r3": 2, "k3v2": 3, "r2": 4, "drop": 5}


class CacheSim:
    """Attention on the cache as the controller left it: the prompt's positions from their
    page's tier (dropped pages masked), later positions fp16 in the rotated basis. With
    ``trace``, sums each decode step's attention per layer and kv head over positions."""

    def __init__(self, recon: Recon, tiers: dict | None, p: int, trace: bool = False):
        self.p, self.trace_on, self.recon = p, trace, recon
        self.kc, self.vc, self.keep = {}, {}, {}
        for layer in recon.k:
            hkv = recon.k[layer].shape[1]
            idx = torch.zeros(hkv, p, dtype=torch.long)  # tail page and unallocated: r16
            if tiers is not None:
                t = tiers[layer]
                full = t.shape[1]
                code = torch.tensor([[LIVE[x] for x in row] for row in t], dtype=torch.long)
                idx[:, :full * PAGE] = code.repeat_interleave(PAGE, dim=1)
            g = idx[None, :, :, None].expand(1, hkv, p, recon.k[layer].shape[-1])
            self.kc[layer] = recon.k[layer].gather(0, g)[0]
            self.vc[layer] = recon.v[layer].gather(0, g)[0]
            self.keep[layer] = idx != LIVE["drop"]
        self.trace = {}

    def reset(self):
        self.trace = {}

    def attend(self, layer, q, k, v, scaling):
        hq, tq, d = q.shape
        hkv, s, _ = k.shape
        g = hq // hkv
        p = self.p
        tail = self.recon.tail
        kk = torch.cat([self.kc[layer], tail.keys(k[:, p:].float())], 1)
        vv = torch.cat([self.vc[layer], tail.values(v[:, p:].float())], 1)
        keep = torch.cat([self.keep[layer], torch.ones(hkv, s - p, dtype=torch.bool)], 1)
        sc = torch.einsum("hgtd,hsd->hgts", q.float().reshape(hkv, g, tq, d), kk) * scaling
        mask = ~keep[:, None, None, :]
        if tq > 1:
            pos = torch.arange(tq)[:, None] + (s - tq)
            mask = mask | (torch.arange(s)[None, :] > pos)[None, None]
        sc = sc.masked_fill(mask, float("-inf"))
        pr = torch.softmax(sc, -1)
        if self.trace_on and tq == 1:
            self.trace.setdefault(layer, []).append(pr.sum(dim=(1, 2)).double().numpy())  # [Hkv, S]
        out = torch.einsum("hgts,hsd->thgd", pr, vv).reshape(tq, hq, d)
        return out.to(q.dtype)


# ------------------------------------------------------------------------------------------
# Settings

def parse_setting(name: str, args) -> dict:
    s = {"name": name, "fp16": False, "obs": None, "mix": 1.0, "keep": 0, "pool": 1, "keeppage": 0, "union": 0, "gunion": 0, "gpin": 0, "radius": 0,
         "drop_eps": args.drop_eps, "budget": args.budget, "recent": args.recent, "pin": [], "force": None}
    for term in name.split("+"):
        key, _, val = term.partition("=")
        try:
            if key == "fp16":
                s["fp16"] = True
            elif key == "whole":
                pass
            elif key == "obs":
                s["obs"] = float(val)
            elif key == "mix":
                s["mix"] = float(val)
            elif key in ("keep", "pool", "keeppage", "union", "gunion", "gpin", "radius", "recent"):
                s[key] = int(val)
            elif key == "nodrop":
                s["drop_eps"] = 1e6
            elif key == "budget":
                s["budget"] = float(val)
            elif key == "pin":
                if val not in ("needle", "needle1", "question"):
                    raise ValueError(val)
                s["pin"].append(val)
            elif key == "force":
                where, _, tier = val.partition(":")
                if where != "needle" or tier not in LIVE:
                    raise ValueError(val)
                s["force"] = tier
            else:
                raise ValueError(key)
        except ValueError:
            raise SystemExit(f"--settings: cannot read term `{term}` of `{name}` (see --help)")
    if (s["keep"] or s["keeppage"] or s["union"] or s["gunion"] or s["gpin"] or s["pool"] > 1 or s["mix"] != 1.0) and s["obs"] is None:
        raise SystemExit(f"--settings: `{name}`: keep/keeppage/pool/mix need obs=")
    return s


def window_pages(pre: Prefill, s: dict, p: int, k: int) -> set:
    """Pages holding any (layer, kv head)'s top-``k`` positions of the observation window, or
    with ``radius=R`` any token within R positions of one (pages of the prompt's full pages)."""
    n = int(round(s["obs"] * p)) if s["obs"] < 1 else int(s["obs"])
    pages = set()
    for layer in pre.k:
        _, win = kvq.hf.exact_attention(pre.q[layer][:, -n:], pre.k[layer], pre.v[layer], pre.scaling, column_sums=True)
        top = np.argsort(-win.numpy(), axis=1)[:, :k]
        r = s["radius"]
        for t in top.flatten().tolist():
            pages |= set(range(max(0, t - r) // PAGE, min(p - 1, t + r) // PAGE + 1))
    return {pg for pg in pages if pg < p // PAGE}


def token_mass(pre: Prefill, layer: int, s: dict, p: int, gpages: set = frozenset()) -> np.ndarray:
    """[Hkv, P] token weights of one layer for setting ``s`` (kvforge.hf.exact_attention's
    observe / observe_weight / keep, plus the pool and keeppage variants)."""
    whole = pre.whole[layer]
    if s["obs"] is None:
        return whole
    n = int(round(s["obs"] * p)) if s["obs"] < 1 else int(s["obs"])
    n = max(1, min(n, p))
    if n > pre.q[layer].shape[1]:
        raise SystemExit(f"obs={n} queries: the prefill kept only {pre.q[layer].shape[1]} (raise --keep-queries)")
    q = pre.q[layer][:, -n:]
    _, win = kvq.hf.exact_attention(q, pre.k[layer], pre.v[layer], pre.scaling, column_sums=True)
    win = win.numpy()
    if s["pool"] > 1:  # SnapKV: average pool of the window's scores over neighbouring tokens
        t = torch.from_numpy(win)[:, None]
        win = F.avg_pool1d(t, s["pool"], stride=1, padding=s["pool"] // 2, count_include_pad=False)[:, 0, :p].numpy()
    mass = win
    if s["mix"] < 1.0:
        mass = s["mix"] * win + (1.0 - s["mix"]) * (n / p) * whole
    mass = mass.copy()
    total = mass.sum(1)
    if s["keep"]:
        top = np.argsort(-win, axis=1)[:, :s["keep"]]
        for h in range(mass.shape[0]):
            mass[h, top[h]] = total[h]
    if s["keeppage"]:
        top = np.argsort(-win, axis=1)[:, :s["keeppage"]]
        for h in range(mass.shape[0]):
            for pg in set((top[h] // PAGE).tolist()):
                mass[h, pg * PAGE:(pg + 1) * PAGE] = total[h] / PAGE
    if s["union"]:  # the pages of every kv head's top positions, kept in all heads of the layer
        top = np.argsort(-win, axis=1)[:, :s["union"]]
        for pg in set((top // PAGE).flatten().tolist()):
            for h in range(mass.shape[0]):
                mass[h, pg * PAGE:(pg + 1) * PAGE] = total[h] / PAGE
    for pg in gpages:
        mass[:, pg * PAGE:(pg + 1) * PAGE] = total[:, None] / PAGE
    return mass


def decide(pre: Prefill, s: dict, eps_tables: dict, args, p: int, needle_pages: list, question_pages: list) -> tuple:
    if s["fp16"]:
        return None, {}
    eps = page_eps(eps_tables["eps_k_rotated"], eps_tables["eps_v_rotated"], s["drop_eps"])
    pins = set()
    for pin in s["pin"]:
        if pin == "needle":
            pins |= set(needle_pages)
        elif pin == "needle1":
            pins |= {x + o for x in needle_pages for o in (-1, 0, 1)}
        else:
            pins |= set(question_pages)
    gpages = window_pages(pre, s, p, s["gunion"]) if s["gunion"] else set()
    if s["gpin"]:
        pins |= window_pages(pre, s, p, s["gpin"])
    tiers, infos = {}, {"feasible": True, "global_pages": sorted(gpages | (pins if s["gpin"] else set()))}
    for layer in pre.k:
        m = token_mass(pre, layer, s, p, gpages)
        tiers[layer], info = allocate(m, eps, s["budget"] * 4.0 * args.head_dim, args.sinks, s["recent"], pins)
        if s["force"]:
            for pg in needle_pages:
                tiers[layer][:, pg] = s["force"]
        infos["feasible"] &= info["feasible"]
    return tiers, infos


# ------------------------------------------------------------------------------------------
# Runs

@torch.no_grad()
def prefill(model, ids, keep_q: int, cache_dir: Path | None = None, key: str = ""):
    """The exact prefill (or its saved copy under ``cache_dir``): (Prefill, HF cache, last logits)."""
    from transformers import DynamicCache

    path = cache_dir / f"prefill-{key}-{len(ids)}-q{keep_q}.pt" if cache_dir else None
    if path is not None and path.is_file():
        st = torch.load(path)
        if st["ids"] == list(ids):
            pre = Prefill(keep_q)
            pre.k, pre.v, pre.q, pre.scaling = st["k"], st["v"], st["q"], st["scaling"]
            pre.whole = {l: m.numpy() for l, m in st["whole"].items()}
            past = DynamicCache(config=model.config)
            for layer in sorted(pre.k):
                past.update(pre.k[layer][None].to(model.dtype), pre.v[layer][None].to(model.dtype), layer)
            return pre, past, st["logits"]
    pre = Prefill(keep_q)
    kvq.set_backend(pre)
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    logits = out.logits[0, -1].float()
    if path is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"ids": list(ids), "k": pre.k, "v": pre.v, "q": pre.q, "scaling": pre.scaling, "logits": logits,
                    "whole": {l: torch.from_numpy(m) for l, m in pre.whole.items()}}, path)
    return pre, out.past_key_values, logits


@torch.no_grad()
def greedy(model, past, p, first_logits, backend, max_new: int, eos: set) -> list:
    kvq.set_backend(backend)
    toks = [int(first_logits.argmax())]
    while len(toks) < max_new and toks[-1] not in eos:
        o = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
        toks.append(int(o.logits[0, -1].argmax()))
    past.crop(-(past.get_seq_length() - p)) if past.get_seq_length() > p else None
    return toks


@torch.no_grad()
def forced_logits(model, past, p, first_logits, backend, target: list) -> torch.Tensor:
    """Logits before each token of ``target`` (teacher-forced) on the simulated cache."""
    kvq.set_backend(backend)
    o = model(input_ids=torch.tensor([target[:-1]]), past_key_values=past, use_cache=True) if len(target) > 1 else None
    logits = torch.cat([first_logits[None], o.logits[0].float()]) if o is not None else first_logits[None]
    past.crop(-(past.get_seq_length() - p)) if past.get_seq_length() > p else None
    return logits


def forced_nll(model, past, p, first_logits, backend, target: list) -> list:
    """Per-token NLL of ``target`` (teacher-forced) on the simulated cache."""
    logits = forced_logits(model, past, p, first_logits, backend, target)
    return F.cross_entropy(logits, torch.tensor(target), reduction="none").tolist()


def margins(tok, logits: torch.Tensor, target: list, code: int) -> dict:
    """fp16's answer teacher-forced up to the code's last token: the step where it is least
    preferred (log-prob of fp16's token minus the best other token's; < 0: greedy decoding
    leaves fp16's answer there)."""
    lp = torch.log_softmax(logits, -1)
    upto = next((i for i in range(len(target)) if str(code) in tok.decode(target[:i + 1])), len(target) - 1)
    gaps = []
    for i, t in enumerate(target[:upto + 1]):
        row = lp[i].clone()
        ref = row[t].item()
        row[t] = float("-inf")
        j = int(row.argmax())
        gaps.append((ref - row[j].item(), i, tok.decode([t]), tok.decode([j])))
    g, i, want, other = min(gaps)
    return {"min_gap": g, "at": i, "fp16_token": want, "rival": other, "nll": float(-sum(lp[i, t] for i, t in enumerate(target[:upto + 1])))}


def locate(tok, ids: list, pos: int, code: int) -> tuple:
    """Positions of the needle sentence (eval.needle_prompt's ``pos`` counts from the start of
    the user's text, not of the prompt): (first token, last token of the code, the code's
    tokens), searched from ``pos``."""
    n = len(ids)
    for end in range(pos, n):
        if str(code) in tok.decode(ids[max(pos, end - 80):end + 1]):
            start = max(i for i in range(max(pos, end - 80), end + 1) if "The secret code" in tok.decode(ids[i:end + 1]))
            first = max(i for i in range(start, end + 1) if str(code)[0] in tok.decode(ids[i:end + 1]))
            return start, end, list(range(first, end + 1))
    raise SystemExit(f"needle code {code} not found after position {pos}")


def trace_summary(trace: dict, tiers: dict | None, p: int, needle: tuple, steps: list) -> dict:
    """Where the answer's attention went (summed over layers, kv heads and the given decode
    steps; each step's attention sums to heads × layers): fractions on the needle's tokens and
    pages, the question (last 128 prompt tokens), the sinks, the new tokens, and by tier."""
    tot = 0.0
    agg = {"needle_tokens": 0.0, "needle_pages": 0.0, "sinks": 0.0, "recent128": 0.0, "generated": 0.0}
    by_tier = {t: 0.0 for t in LIVE}
    a, b = needle
    npg = set(range(a // PAGE, b // PAGE + 1))
    for layer, rows in trace.items():
        for st in steps:
            if st >= len(rows):
                continue
            m = rows[st]  # [Hkv, S]
            tot += m.sum()
            agg["needle_tokens"] += m[:, a:b + 1].sum()
            agg["needle_pages"] += sum(m[:, pg * PAGE:(pg + 1) * PAGE].sum() for pg in npg)
            agg["sinks"] += m[:, :PAGE].sum()
            agg["recent128"] += m[:, p - 128:p].sum()
            agg["generated"] += m[:, p:].sum()
            if tiers is not None:
                t = tiers[layer]
                for h in range(t.shape[0]):
                    for pg in range(t.shape[1]):
                        by_tier[t[h, pg]] += m[h, pg * PAGE:(pg + 1) * PAGE].sum()
    out = {k: v / tot for k, v in agg.items()} if tot else agg
    if tiers is not None and tot:
        out["by_tier"] = {k: v / tot for k, v in by_tier.items()}
    return out


def needle_readers(trace: dict, needle: tuple, steps: list, top: int = 12) -> list:
    """The (layer, kv head)s whose answer steps read the needle's tokens most in fp16: the
    attention mass on the needle (summed over the group's query heads and the steps)."""
    a, b = needle
    rows = []
    for layer, st in trace.items():
        m = sum(st[i][:, a:b + 1] for i in steps if i < len(st))
        for h in range(m.shape[0]):
            rows.append({"layer": int(layer), "head": h, "needle_mass": float(m[h].sum()), "code_page": b // PAGE})
    return sorted(rows, key=lambda r: -r["needle_mass"])[:top]


def tier_counts(tiers: dict, pages) -> dict:
    c = {}
    for layer in tiers:
        for pg in pages:
            if pg < tiers[layer].shape[1]:
                for x in tiers[layer][:, pg]:
                    c[x] = c.get(x, 0) + 1
    return c


def ladder_counts(tiers: dict) -> dict:
    c = {}
    for t in tiers.values():
        for x in t.flat:
            c[x] = c.get(x, 0) + 1
    return c


def run_needle(model, tok, args, eps_tables, settings, hay, eos) -> dict:
    import eval as ev

    res = {}
    for depth in args.depth_list:
        code = 1000 + int(depth * 7919) % 9000
        ids, pos = ev.needle_prompt(tok, hay, args.context, depth, code)
        p = len(ids)
        a, b, digits = locate(tok, ids, pos, code)
        needle_pages = sorted(set(range(a // PAGE, b // PAGE + 1)))
        question_pages = sorted(set(range((p - 40) // PAGE, p // PAGE)))
        keep_q = max([512] + [int(round(s["obs"] * p)) if s["obs"] and s["obs"] < 1 else int(s["obs"] or 0) for s in settings])
        t0 = time.time()
        pre, past, first = prefill(model, ids, keep_q, args.cache_dir, f"needle{depth}")
        recon = Recon(pre)
        log(f"depth {depth}: {p} tokens, needle at {a}..{b} (pages {needle_pages}), prefill {time.time() - t0:.0f}s")
        d = {"code": code, "prompt_tokens": p, "needle_tokens": [a, b], "needle_pages": needle_pages,
             "question_pages": question_pages, "full_pages": p // PAGE, "settings": {}}
        ref_answer, ref_trace = None, None
        for s in settings:
            ts = time.time()
            tiers, info = decide(pre, s, eps_tables, args, p, needle_pages, question_pages)
            cache = CacheSim(recon, tiers, p, trace=True)
            toks = greedy(model, past, p, first, cache, args.max_new, eos)
            answer = tok.decode(toks, skip_special_tokens=True)
            hit = str(code) in re.findall(r"\d+", answer)
            code_toks = tok(f"{code}", add_special_tokens=False)["input_ids"]
            if ref_answer is None:
                ref_answer = toks
            # NLL of the code's tokens, teacher-forced after fp16's answer prefix up to the code
            pref = ref_answer
            txt = [tok.decode(pref[:i]) for i in range(len(pref) + 1)]
            cut = next((i for i in range(len(pref) + 1) if str(code)[0] in txt[i]), None)
            target = (pref[:cut - 1] if cut else []) + code_toks
            nll = forced_nll(model, past, p, first, CacheSim(recon, tiers, p), target)
            ref_logits = forced_logits(model, past, p, first, CacheSim(recon, tiers, p), ref_answer)
            steps = list(range(min(len(toks), 8)))
            row = {"answer": answer, "hit": hit, "code_nll": sum(nll[-len(code_toks):]),
                   "fp16_answer": margins(tok, ref_logits, ref_answer, code),
                   "trace": trace_summary(cache.trace, tiers, p, (a, b), steps), "feasible": info.get("feasible", True),
                   "global_pages": info.get("global_pages")}
            if tiers is not None:
                row["needle_page_tiers"] = tier_counts(tiers, needle_pages)
                row["needle_neighbour_tiers"] = tier_counts(tiers, [needle_pages[0] - 1, needle_pages[-1] + 1])
                row["all_tiers"] = ladder_counts(tiers)
                row["needle_page_weight_rank"] = weight_ranks(pre, s, p, needle_pages)
            if s["fp16"]:
                ref_trace = cache.trace
                readers = needle_readers(ref_trace, (a, b), steps)
                d["fp16_needle_readers"] = readers
            if tiers is not None and ref_trace is not None:
                row["reader_tiers"] = [tiers[r["layer"]][r["head"], b // PAGE] for r in d.get("fp16_needle_readers", [])]
                # fp16's answer attention read against this setting's tiers
                row["fp16_attention_by_tier"] = trace_summary(ref_trace, tiers, p, (a, b), steps).get("by_tier")
            d["settings"][s["name"]] = row
            log(f"  {s['name']:>28}: {'HIT ' if hit else 'miss'} {answer.strip()[:40]!r:44} code nll {row['code_nll']:.2f}"
                f"  fp16 answer: gap {row['fp16_answer']['min_gap']:+.2f} at {row['fp16_answer']['at']} ({row['fp16_answer']['fp16_token']!r} vs {row['fp16_answer']['rival']!r})"
                f"  needle pages {row.get('needle_page_tiers', '')} readers {''.join(SHORT[t] for t in row.get('reader_tiers', []))}  G{len(row.get('global_pages') or [])}  {time.time() - ts:.0f}s")
        res[str(depth)] = d
        del pre, recon, past
    return res


def weight_ranks(pre, s, p, pages) -> dict:
    """Median (over layers and kv heads) rank of the needle pages' weight among the free
    pages (0 = heaviest), and the median fraction of the head's mass they hold."""
    ranks, fracs = [], []
    for layer in pre.k:
        m = token_mass(pre, layer, s, p)
        full = p // PAGE
        w = m[:, :full * PAGE].reshape(m.shape[0], full, PAGE).sum(2)
        for h in range(w.shape[0]):
            order = np.argsort(-w[h])
            rank = {int(pg): int(r) for r, pg in enumerate(order)}
            ranks.append(min(rank[pg] for pg in pages if pg < full))
            fracs.append(sum(w[h, pg] for pg in pages if pg < full) / max(w[h].sum(), 1e-30))
    return {"median_rank": float(np.median(ranks)), "median_mass_fraction": float(np.median(fracs)), "pages": p // PAGE}


@torch.no_grad()
def run_ppl(model, tok, args, eps_tables, settings) -> dict:
    res = {}
    for text in args.ppl_text_list:
        ids = kvq.book_tokens(tok, text, args.data)[:args.ppl_context]
        prompt, tail = ids[:-args.cont], ids[-args.cont:]
        p = len(prompt)
        keep_q = max([512] + [int(round(s["obs"] * p)) if s["obs"] and s["obs"] < 1 else int(s["obs"] or 0) for s in settings])
        t0 = time.time()
        pre, past, first = prefill(model, prompt, keep_q, args.cache_dir, text)
        recon = Recon(pre)
        log(f"ppl {text}: prefill {p} tokens {time.time() - t0:.0f}s")
        row = {}
        for s in settings:
            tiers, _ = decide(pre, s, eps_tables, args, p, [], [])
            nll = forced_nll(model, past, p, first, CacheSim(recon, tiers, p), tail)
            row[s["name"]] = math.exp(sum(nll) / len(nll))
        ref = row.get("fp16")
        res[text] = {"ppl": row, "ratio": {k: v / ref for k, v in row.items()} if ref else None}
        log(f"  {text}: " + ", ".join(f"{k} {v:.3f}" for k, v in (res[text]["ratio"] or row).items()))
        del pre, recon, past
    if all(r["ratio"] for r in res.values()) and res:
        res["mean_ratio"] = {k: float(np.mean([r["ratio"][k] for t, r in res.items() if t != "mean_ratio"])) for k in next(iter(res.values()))["ratio"]}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file or folder (default: data/model, then /root/m)")
    ap.add_argument("--data", type=Path, default=kvq.DATA, help="folder holding austen/ (default: %(default)s)")
    ap.add_argument("--context", type=int, default=4096, help="needle prompt tokens (budget.py --needle-context)")
    ap.add_argument("--depths", default="0.2,0.5,0.8", help="needle depths ('' skips the needle test)")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help="needle settings (see above)")
    ap.add_argument("--budget", type=float, default=0.2, help="byte budget, fraction of fp16 (budget.py --rotated)")
    ap.add_argument("--sinks", type=int, default=64)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--drop-eps", type=float, default=1.0, help="ε of a dropped token (budget.py --rotated-drop-eps)")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--calib", type=Path, default=CALIB_DEFAULT, help="a budget.py result JSON whose ε tables to use")
    ap.add_argument("--ppl-texts", default="", help="texts for budget.py's perplexity protocol ('' skips)")
    ap.add_argument("--ppl-settings", default="fp16,whole,obs=64", help="settings for the perplexity runs")
    ap.add_argument("--ppl-context", type=int, default=2048)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, help="save / reuse exact prefills here (keyed by prompt)")
    ap.add_argument("--out", type=Path, help="result JSON (default: benches/results/needle-trace-cpu-<date>.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.depth_list = [float(x) for x in args.depths.split(",") if x]
    args.ppl_text_list = [t for t in args.ppl_texts.split(",") if t]
    if any(not 0.0 <= x <= 1.0 for x in args.depth_list):
        raise SystemExit("--depths: fractions in [0, 1]")
    if not args.calib.is_file():
        raise SystemExit(f"--calib {args.calib}: no such file (a budget.py result with a 'calibration' entry)")
    eps_tables = json.loads(args.calib.read_text()).get("calibration")
    if not eps_tables or "eps_k_rotated" not in eps_tables:
        raise SystemExit(f"--calib {args.calib}: no rotated ε tables (calibration.eps_k_rotated)")
    for t in args.ppl_text_list:
        if not (args.data / "austen" / f"{t}.txt").is_file():
            raise SystemExit(f"--ppl-texts: no {args.data / 'austen' / (t + '.txt')}")
    settings = [parse_setting(n, args) for n in args.settings.split(",") if n]
    ppl_settings = [parse_setting(n, args) for n in args.ppl_settings.split(",") if n]
    gguf = kvq.find_gguf(args.model)
    model, tok = kvq.load_model(gguf, "cpu", torch.float32)
    args.head_dim = model.config.head_dim
    if args.head_dim != 64:
        raise SystemExit(f"page bytes are tabulated for head_dim 64, the model has {args.head_dim}")
    eos = {tok.eos_token_id} | set(np.atleast_1d(model.generation_config.eos_token_id or []).tolist())
    out = args.out or kvq.ROOT / "benches" / "results" / f"needle-trace-cpu-{dt.date.today().isoformat()}.json"
    result = {"meta": {"what": "CPU simulation of RDKV on specs/rotated.toml: needle retrieval and the answer's attention trace",
                       "argv": sys.argv[1:], "date": dt.date.today().isoformat(), "torch": torch.__version__,
                       "model": gguf.name, "dtype": "fp32 (GPU runs: fp16)", "calibration_from": str(args.calib.name),
                       "eps_k_rotated": eps_tables["eps_k_rotated"], "eps_v_rotated": eps_tables["eps_v_rotated"],
                       "page_bytes_d64": PAGE_BYTES, "budget": args.budget, "sinks": args.sinks, "recent": args.recent}}
    t0 = time.time()
    if args.depth_list:
        hay = kvq.book_tokens(tok, "northangerabbey", args.data)
        result["needle"] = run_needle(model, tok, args, eps_tables, settings, hay, eos)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
    if args.ppl_text_list:
        result["ppl"] = run_ppl(model, tok, args, eps_tables, ppl_settings)
    result["meta"]["seconds"] = time.time() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
