"""ParisKV retrieval decode (seed 001 §4, issue 27) in torch, for the quality benchmark.

A port of the f64 reference ``crates/kvforge-paris`` (its module docs define every step):
per-key summaries (``summarize``), the query's centroid order (``prepare_queries``), the
multi-tier collision bonuses and vote (``bonuses``, ``vote``), the integer top-C with ties in
index order (``top_c_mask``), the eq. 10 rerank estimate (``key_estimate_rows``) and the
top-k. ``test_paris_sim.py`` checks it against the reference on the fixture
``fixtures/paris-reference.json`` (``cargo run --release -p kvforge-paris --example
paris_fixture``): summaries bit for bit, bonus tables and scores bit for bit, candidates and
top-k index for index, estimates to 1e-9.

The attention backend ``sim:paris-k<k>[-oracle][-qhead|-hmax][-s<sinks>][-l<local>][-d<dense_below>]``
(``ParisSimBackend``; defaults k 256, sinks 64, local 256, dense below 2048 retrieval-region
keys, ``Schedule::default``'s (ρ, β), 6 tiers) treats **every query position as a decode step**
(causal, teacher forced): the query at position ``p`` sees the regions a ParisKV cache of
``p + 1`` tokens has right after its prefill (``kvforge_paris::Regions::after_prefill``):
sinks ``[0, s)``, retrieval ``[s, r)`` with ``r = max(p + 1 − local, s)``, local ``[r, p]``.
It attends exactly (fp16 K/V, one softmax) over sinks + local + the top-k of the retrieval
region that the ParisKV pipeline selects; below ``dense_below`` retrieval keys it attends to
all of them, as the runtime's schedule does. This is stricter than the system, whose prefill is
dense: here the prompt's own positions are decoded with retrieval too (their K/V, in later
layers, then carry the retrieval error forward, as generated tokens' do).

**Retrieval per kv head** (the runtime's default, ``ParisGeometry::per_query_head`` false): the
``G`` query heads of a kv head share one retrieval whose query is the sum of theirs
(``group_queries``, ``kvforge_paris::group_query``: f64, heads added in order), so a key's
score is the sum of the heads' logits; the group shares one vote, top-C, rerank and top-k, and
each query head still attends its own softmax over the shared rows. ``-qhead`` retrieves per
query head instead (the runtime's ``per_query_head``, the first version of this backend).
``-hmax`` keeps the kv head's shared vote and top-C but ranks the candidates by the largest of
the ``G`` heads' own estimates (the oracle: by the largest head logit), so a key that one head
attends to is not averaged away by the others: the runtime's ``Rank::GroupMax`` (its default,
kernel ``rerank_hmax``; ``kvforge_paris::retrieve_group_max`` is the reference).

``-oracle`` selects the exact top-k of the retrieval region by the true score instead (per kv
head: ``Σ_g q_g · k``, the summed query's; with ``-qhead``: each head's ``q·k``), which
separates the retrieval's error from the truncation to k keys. The non-oracle backend also
records, per layer, the mean Recall@k of its selection against that exact top-k (per
retrieval: per kv head and position, or per query head and position with ``-qhead``).
"""

from __future__ import annotations

import math

import torch

import kvq

SEED = kvq.ROT_DEFAULT_SEED
# Prop. 4.1 Lloyd-Max levels at subspace dim m, 4 bits: kvforge-spec's
# `codecs::rotated::levels(m, 4).levels_f32` (written into the fixture, checked by the test).
LEVELS = {8: [-0.7648350596427917, -0.6193476319313049, -0.5030220746994019, -0.4002712666988373, -0.3053238093852997,
              -0.2152012139558792, -0.12804365158081055, -0.04250866547226906, 0.04250866547226906, 0.12804365158081055,
              0.2152012139558792, 0.3053238093852997, 0.4002712666988373, 0.5030220746994019, 0.6193476319313049,
              0.7648350596427917]}
# Schedule::default: (min_len, rho, beta), dense below, candidates >= 8 k.
SCHEDULE = [(0, 0.25, 0.10), (64 << 10, 0.20, 0.10), (512 << 10, 0.20, 0.05)]
# The 64 B summaries (`SummaryLayout::Whole64`, the runtime's default; kvforge-paris compact.rs,
# `Layout::whole_eighth`): every coordinate of the rotated unit key on `levels(D, 4)`, the 8
# coordinates j ≡ D/8 − 1 (mod D/8) on `levels(D, 3)`, one weight per key on an 8-bit log grid
# of 1/32 octave whose top code is the largest weight of the kv head's prefill. Tables:
# kvforge-spec's `levels(D, bits).levels_f32` (written into the fixture, checked by the test).
WHOLE_LEVELS = {
    64: ([-0.3307963013648987, -0.2529137134552002, -0.1988561451435089, -0.15492552518844604, -0.11648675054311752, -0.08131176978349686, -0.048089783638715744, -0.015919022262096405, 0.015919022262096405, 0.048089783638715744, 0.08131176978349686, 0.11648675054311752, 0.15492552518844604, 0.1988561451435089, 0.2529137134552002, 0.3307963013648987],
         [-0.265625, -0.16796875, -0.09375, -0.03125, 0.03125, 0.09375, 0.16796875, 0.265625]),
    128: ([-0.23766382038593292, -0.18083596229553223, -0.14180520176887512, -0.11028836667537689, -0.08282845467329025, -0.05777229741215706, -0.03415156900882721, -0.011302496306598186, 0.011302496306598186, 0.03415156900882721, 0.05777229741215706, 0.08282845467329025, 0.11028836667537689, 0.14180520176887512, 0.18083596229553223, 0.23766382038593292],
         [-0.1875, -0.1171875, -0.06640625, -0.021484375, 0.021484375, 0.06640625, 0.1171875, 0.1875]),
}
WHOLE_STEPS = 32
# Schedule::whole64: Schedule::default with ρ 0.30 from 64K keys on.
SCHEDULE_WHOLE64 = [(0, 0.25, 0.10), (64 << 10, 0.30, 0.10), (512 << 10, 0.30, 0.05)]
DENSE_BELOW = 2048
MIN_CANDIDATES_PER_K = 8


class Config:
    """``ParisConfig::default_for(d)``: B = d/8 subspaces of m = 8, the rotated tier's seed."""

    def __init__(self, head_dim: int, tiers: int = 6, seed: int = SEED):
        self.d, self.tiers, self.seed = head_dim, tiers, seed
        self.b = head_dim // 8
        self.m = 8
        if self.m not in LEVELS or head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
            raise ValueError(f"ParisKV sim: head dim {head_dim} (a power of two, 16 to 256, with m = 8)")
        self.cents = 1 << self.m

    def levels(self, device, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(LEVELS[self.m], dtype=torch.float64).to(torch.float32).to(device=device, dtype=dtype)

    def summary_bytes(self) -> int:
        return self.b + self.d // 2 + 2 * self.b


def plan(n: int, k: int, dense_below: int = DENSE_BELOW, schedule=None):
    """``Schedule::plan``: (rho, beta, candidates, k, dense) for ``n`` retrieval-region keys
    (``schedule``: ``SCHEDULE``, or ``SCHEDULE_WHOLE64`` for the 64 B summaries)."""
    rho, beta = next((r, b) for m, r, b in reversed(schedule or SCHEDULE) if m <= n)
    cands = min(max(math.ceil(beta * n), MIN_CANDIDATES_PER_K * k), n)
    return rho, beta, cands, min(k, n), n < dense_below


def group_queries(q: torch.Tensor, g: int) -> torch.Tensor:
    """``group_query`` for queries ``[Hq, ..., D]``: ``[Hq/g, ..., D]`` f64, the ``g``
    consecutive query heads of each kv head summed in order (``((0 + q₀) + q₁) + …``, the
    reference's f64 order)."""
    q64 = q.double().reshape(q.shape[0] // g, g, *q.shape[1:])
    acc = torch.zeros_like(q64[:, 0])
    for i in range(g):
        acc = acc + q64[:, i]
    return acc


def _seq_sum_sq(x64: torch.Tensor) -> torch.Tensor:
    """Σ_j x_j² over the last dim in f64, j in order (the reference's summation order)."""
    acc = torch.zeros(x64.shape[:-1], dtype=torch.float64, device=x64.device)
    for j in range(x64.shape[-1]):
        acc = acc + x64[..., j] * x64[..., j]
    return acc


def _rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``hadamard::rotate`` in x's precision: signs, butterflies, then × 1/√d (f32: the f64
    value rounded once)."""
    d = x.shape[-1]
    s = torch.tensor(kvq.rotation_signs(d, seed), dtype=x.dtype, device=x.device)
    inv = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float64).to(x.dtype).to(x.device)
    return kvq.fwht(x * s) * inv


def summarize(keys: torch.Tensor, cfg: Config):
    """Summaries of keys ``[..., n, D]`` (any float dtype; summarised from their f32 values):
    ``(ids uint8 [..., n, B], codes uint8 [..., n, D] one per channel, weights f32 [..., n, B]
    as stored: fp16-rounded)``."""
    x = keys.to(torch.float32)
    x64 = x.double()
    nrm = _seq_sum_sq(x64).sqrt().to(torch.float32)
    inv = torch.ones_like(nrm) / nrm
    zero = (nrm == 0) | ~torch.isfinite(inv)
    kt = _rotate(x * torch.where(zero, torch.zeros_like(inv), inv)[..., None], cfg.seed)
    sub = kt.reshape(*kt.shape[:-1], cfg.b, cfg.m)
    r = _seq_sum_sq(sub.double()).sqrt().to(torch.float32)
    rinv = torch.ones_like(r) / r
    zsub = (r == 0) | ~torch.isfinite(rinv) | zero[..., None]
    u = sub * torch.where(zsub, torch.zeros_like(rinv), rinv)[..., None]
    lv = cfg.levels(x.device)
    tau = (lv[1:] + lv[:-1]) * 0.5
    code = (u[..., None] > tau).sum(-1)  # thresholds strictly below u
    code = torch.where(zsub[..., None], torch.full_like(code, 8), code)
    bitw = (1 << torch.arange(cfg.m, device=x.device)).to(code.dtype)
    ids = ((code >= 8).to(code.dtype) * bitw).sum(-1)
    lv64 = lv.double()
    alpha = torch.zeros(r.shape, dtype=torch.float64, device=x.device)
    u64 = u.double()
    for j in range(cfg.m):
        alpha = alpha + lv64[code[..., j]] * u64[..., j]
    w = (nrm.double()[..., None] * r.double() / torch.where(alpha > 0, alpha, torch.ones_like(alpha))).to(torch.float32)
    w = torch.where((alpha > 0) & ~zsub, w, torch.zeros_like(w)).to(torch.float16).to(torch.float32)
    return ids.to(torch.uint8), code.reshape(*code.shape[:-2], cfg.d).to(torch.uint8), w


def whole_low(d: int, device=None) -> torch.Tensor:
    """``[D]`` bool: the coordinates on 3-bit codes (``Layout::is_low``, low = 8)."""
    return (torch.arange(d, device=device) % (d // 8)) == d // 8 - 1


def whole_tables(d: int, device=None):
    """``(levels(D, 4), levels(D, 3))`` f32 and their thresholds (midpoints, f32)."""
    l4, l3 = (torch.tensor(t, dtype=torch.float64).to(torch.float32).to(device) for t in WHOLE_LEVELS[d])
    return l4, l3, (l4[1:] + l4[:-1]) * 0.5, (l3[1:] + l3[:-1]) * 0.5


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Rust's ``f64::round``: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def summarize_whole(keys: torch.Tensor, cfg: Config):
    """The 64 B summaries' codes of keys ``[..., n, D]`` (``compact_key`` under
    ``Layout::whole_eighth``): ``(codes uint8 [..., n, D] level indices, logw int64 [..., n] =
    round(32 log2 w) (the weight before its grid), valid bool [..., n]: w > 0)``. A zero key
    codes the middle level everywhere with weight 0. The ids are those of :func:`summarize`
    (the codes' sign plane)."""
    d = keys.shape[-1]
    x = keys.to(torch.float32)
    nrm = _seq_sum_sq(x.double()).sqrt().to(torch.float32)
    inv = torch.ones_like(nrm) / nrm
    zero = (nrm == 0) | ~torch.isfinite(inv)
    kt = _rotate(x * torch.where(zero, torch.zeros_like(inv), inv)[..., None], cfg.seed)
    l4, l3, t4, t3 = whole_tables(d, x.device)
    low = whole_low(d, x.device)
    code = torch.where(low, (kt[..., None] > t3).sum(-1), (kt[..., None] > t4).sum(-1))
    code = torch.where(zero[..., None], torch.where(low, 4, 8).to(code.dtype), code)
    lv = torch.where(low, l3[code.clamp(max=7)], l4[code]).double()
    kt64 = kt.double()
    alpha = torch.zeros(kt.shape[:-1], dtype=torch.float64, device=x.device)
    for j in range(d):  # the reference's summation order
        alpha = alpha + lv[..., j] * kt64[..., j]
    valid = (alpha > 0) & ~zero
    w = nrm.double() / torch.where(valid, alpha, torch.ones_like(alpha))
    logw = torch.where(valid, _round_away(WHOLE_STEPS * torch.log2(w)), torch.zeros_like(w)).long()
    return code.to(torch.uint8), logw, valid


def whole_ids(codes: torch.Tensor, cfg: Config) -> torch.Tensor:
    """``[..., n, B]`` centroid ids of whole codes: their sign plane (``CompactSummaries::id``,
    a code in the upper half of its table is a positive coordinate), which equals
    :func:`summarize`'s ids of the same keys."""
    half = torch.where(whole_low(cfg.d, codes.device), 4, 8)
    bits = (codes.long() >= half).long().reshape(*codes.shape[:-1], cfg.b, cfg.m)
    return (bits << torch.arange(cfg.m, device=codes.device)).sum(-1).to(torch.uint8)


def whole_levels(codes: torch.Tensor) -> torch.Tensor:
    """``[..., n, D]`` f64 levels ``ℓ_{c_j}`` of whole codes (the estimate's rows before the
    weight: ``ŝ = ‖q‖ w (q̃ · row)``)."""
    d = codes.shape[-1]
    l4, l3, _, _ = whole_tables(d, codes.device)
    c = codes.long()
    return torch.where(whole_low(d, codes.device), l3[c.clamp(max=7)], l4[c]).double()


def whole_grid_base(logw: torch.Tensor, valid: torch.Tensor) -> int:
    """``LogGrid::fit``: the base whose code 255 is the largest weight (−128 if none)."""
    return int(logw[valid].max()) - 255 if bool(valid.any()) else -128


def whole_weights(logw: torch.Tensor, valid: torch.Tensor, base) -> tuple:
    """``(codes, values f64)`` of the weights on the grid of ``base`` (an int, or a tensor
    broadcasting against ``logw``): code ``clamp(logw − base, 1, 255)``, 0 for no weight;
    value ``2^((base + code) / 32)``."""
    base = torch.as_tensor(base, device=logw.device)
    code = torch.where(valid, (logw - base).clamp(1, 255), torch.zeros_like(logw))
    val = torch.where(code > 0, torch.pow(2.0, (base + code).double() / WHOLE_STEPS), torch.zeros_like(code, dtype=torch.float64))
    return code, val


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[.., D]`` 4-bit codes to the reference's bytes: channel c in byte c/2, low nibble even."""
    c = codes.to(torch.int32)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def histogram(ids: torch.Tensor, cfg: Config) -> torch.Tensor:
    """``[B][2^m]`` keys per centroid of ids ``[n, B]`` (int64)."""
    off = torch.arange(cfg.b, device=ids.device) * cfg.cents
    flat = (ids.long() + off).reshape(-1)
    return torch.bincount(flat, minlength=cfg.b * cfg.cents).reshape(cfg.b, cfg.cents)


def prepare_queries(q: torch.Tensor, cfg: Config):
    """``Query::new`` for queries ``[..., D]``: ``(norm f64 [...], rotated q̃ f64 [..., D],
    order int64 [..., B, 2^m])``, centroids by decreasing ⟨q̃_b, ω⟩, ties by id."""
    q64 = q.double()
    nrm = _seq_sum_sq(q64).sqrt()
    unit = torch.where(nrm[..., None] > 0, q64 / torch.where(nrm > 0, nrm, torch.ones_like(nrm))[..., None], torch.zeros_like(q64))
    qr = _rotate(unit, cfg.seed)
    sub = qr.reshape(*qr.shape[:-1], cfg.b, cfg.m)
    w = torch.arange(cfg.cents, device=q.device)
    sgn = torch.where(((w[:, None] >> torch.arange(cfg.m, device=q.device)) & 1) == 1, 1.0, -1.0).to(torch.float64)  # [2^m, m]
    score = torch.zeros(*sub.shape[:-1], cfg.cents, dtype=torch.float64, device=q.device)
    for j in range(cfg.m):
        score = score + sgn[:, j] * sub[..., j, None]
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return nrm, qr, order


def bonuses(order: torch.Tensor, hist: torch.Tensor, n: torch.Tensor, rho: torch.Tensor, tiers: int) -> torch.Tensor:
    """``Query::bonuses``: order ``[..., B, 2^m]``, hist ``[..., B, 2^m]`` (broadcast), ``n``
    and ``rho`` per leading index ``[...]``; returns int64 bonuses ``[..., B, 2^m]``."""
    hist = hist.expand(order.shape) if hist.dim() < order.dim() else hist
    target = torch.clamp(torch.ceil(rho.double() * n.double()), min=1).long()[..., None, None]
    hs = torch.gather(hist.long(), -1, order)
    before = torch.cumsum(hs, -1) - hs
    bs = torch.where(before < target, tiers - torch.div(before * tiers, target, rounding_mode="floor"), torch.zeros_like(before))
    return torch.zeros_like(bs).scatter(-1, order, bs)


def vote(bonus: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Collision scores ``[..., n]`` (int64) of keys with ids ``[n, B]`` under bonuses ``[..., B, 2^m]``."""
    out = None
    for b in range(ids.shape[-1]):
        s = torch.index_select(bonus[..., b, :], -1, ids[:, b].long())
        out = s if out is None else out + s
    return out


def one_hot_ids(ids: torch.Tensor, cfg: Config, dtype) -> torch.Tensor:
    """``[..., n, B]`` ids as ``[..., n, B·2^m]`` one-hot rows: ``bonus_flat @ one_hot.T`` is the
    vote (integer sums ≤ 255, exact in fp16 and f32)."""
    oh = torch.zeros(*ids.shape[:-1], cfg.b * cfg.cents, dtype=dtype, device=ids.device)
    return oh.scatter_(-1, ids.long() + torch.arange(cfg.b, device=ids.device) * cfg.cents, 1)


def top_c_mask(scores: torch.Tensor, region: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``top_candidates``: of each row of ``scores [..., n]`` within ``region`` (bool, broadcast),
    the ``c [...]`` best by score then lowest index (ties at the threshold in index order)."""
    n = scores.shape[-1]
    idx = torch.arange(n, device=scores.device)
    key = torch.where(region, scores.long() * (1 << 32) + (n - 1 - idx), torch.full_like(scores.long(), -1))
    cmax = int(c.max().item()) if c.numel() else 0
    if cmax == 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    val, pos = torch.topk(key, min(cmax, n), dim=-1)
    keep = (torch.arange(pos.shape[-1], device=scores.device) < c[..., None]) & (val >= 0)
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter(-1, pos, keep)


def key_estimate_rows(codes: torch.Tensor, weights: torch.Tensor, cfg: Config) -> torch.Tensor:
    """``[n, D]`` f64 rows ``w_b ℓ_{c_j}`` (j in subspace b): eq. 10's estimate of ⟨k, q⟩ is
    ``(‖q‖ q̃) · row``."""
    lv = cfg.levels(codes.device).double()
    return lv[codes.long()] * weights.double().repeat_interleave(cfg.m, dim=-1)


def top_k_mask(est: torch.Tensor, allowed: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The ``k [...]`` largest ``est [..., n]`` among ``allowed`` (the reference breaks exact
    ties by the lower index; ``torch.topk`` does not promise to, and f64 estimates of distinct
    keys do not tie)."""
    e = torch.where(allowed, est, torch.full_like(est, -math.inf))
    kmax = int(k.max().item()) if k.numel() else 0
    if kmax == 0:
        return torch.zeros(est.shape, dtype=torch.bool, device=est.device)
    order = torch.topk(e, min(kmax, est.shape[-1]), dim=-1).indices
    keep = torch.arange(order.shape[-1], device=est.device) < k[..., None]
    keep = keep & torch.gather(allowed, -1, order)
    return torch.zeros(est.shape, dtype=torch.bool, device=est.device).scatter(-1, order, keep)


class ParisSimBackend:
    """``sim:paris-...`` (module docs)."""

    measured_bytes = False

    def __init__(self, name: str, k: int = 256, sinks: int = 64, local: int = 256, dense_below: int = DENSE_BELOW,
                 oracle: bool = False, tiers: int = 6, per_query_head: bool = False, head_max: bool = False, whole64: bool = False):
        self.name, self.k, self.sinks, self.local, self.dense_below = name, k, sinks, local, dense_below
        # the 64 B summaries (the runtime's default) and their schedule, else the seed's
        self.whole64 = whole64
        self.schedule = SCHEDULE_WHOLE64 if whole64 else SCHEDULE
        self.oracle, self.tiers, self.per_query_head = oracle, tiers, per_query_head
        # per kv head, ranked by the largest of the group's heads' estimates (sim only)
        self.head_max = head_max and not per_query_head
        self.cache = {}
        self.recall = {}  # layer -> [sum of Recall@k, retrieval queries]
        self.stats = {"recall_vs_exact_topk_by_layer": {}, "retrieval_queries": 0, "dense_queries": 0}

    @staticmethod
    def parse(name: str) -> "ParisSimBackend":
        """``sim:paris-k256-oracle-qhead-s64-l256-d2048-t6`` (any order after ``paris``)."""
        rest = name.partition(":")[2]
        parts = rest.split("-")
        kw = {}
        keys = {"k": "k", "s": "sinks", "l": "local", "d": "dense_below", "t": "tiers"}
        for p in parts[1:]:
            if p == "oracle":
                kw["oracle"] = True
            elif p == "qhead":
                kw["per_query_head"] = True
            elif p == "hmax":
                kw["head_max"] = True
            elif p == "w64":
                kw["whole64"] = True
            elif p[:1] in keys and p[1:].isdigit():
                kw[keys[p[:1]]] = int(p[1:])
            else:
                raise SystemExit(f"unknown ParisKV backend `{name}`: sim:paris-k<k>[-oracle][-qhead|-hmax][-w64][-s<sinks>][-l<local>][-d<dense_below>][-t<tiers>]")
        return ParisSimBackend(name, **kw)

    def reset(self):
        self.cache = {}

    def _summaries(self, layer, k):
        """Summaries of k ``[Hkv, S, D]``, encoding only rows not yet seen in this sequence."""
        cfg = Config(k.shape[-1], self.tiers)
        c = self.cache.get(layer)
        s = k.shape[1]
        if c is None or c["n"] > s:
            c = {"n": 0, "ids": None, "rows": None, "logw": None, "valid": None}
        if c["n"] < s:
            if self.whole64:
                # Rows of levels only: a key's weight code depends on the grid of the prefill
                # its query sees (`_select`); the ids are the codes' sign plane.
                wc, logw, valid = summarize_whole(k[:, c["n"]:], cfg)
                ids, rows = whole_ids(wc, cfg), whole_levels(wc)
                c["logw"] = logw if c["logw"] is None else torch.cat([c["logw"], logw], 1)
                c["valid"] = valid if c["valid"] is None else torch.cat([c["valid"], valid], 1)
            else:
                ids, codes, w = summarize(k[:, c["n"]:], cfg)
                rows = key_estimate_rows(codes, w, cfg)
            c["ids"] = ids if c["ids"] is None else torch.cat([c["ids"], ids], 1)
            c["rows"] = rows if c["rows"] is None else torch.cat([c["rows"], rows], 1)
            c["n"] = s
        self.cache[layer] = c
        return cfg, c["ids"], c["rows"]

    def attend(self, layer, q, k, v, scaling):
        hq, tq, d = q.shape
        hkv, s, _ = k.shape
        g = hq // hkv
        dev = q.device
        pos = torch.arange(s - tq, s, device=dev)
        s0 = torch.clamp(pos + 1, max=self.sinks)
        r_end = torch.maximum(pos + 1 - self.local, s0)
        n_reg = r_end - s0
        retr = (n_reg >= self.dense_below) & (n_reg > self.k)
        self.stats["dense_queries"] += int((~retr).sum()) * hq
        if not bool(retr.any()):
            return kvq.eager_causal(q, k, v, scaling)
        self.stats["retrieval_queries"] += int(retr.sum()) * hq
        ks, vs = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
        # Retrieval rows: one per kv head (its group's summed query) or one per query head.
        nr, share = (hq, 1) if self.per_query_head else (hkv, g)
        kv_of = torch.arange(nr, device=dev) // (g // share)  # retrieval row -> kv head
        row_of = torch.arange(hq, device=dev) // share  # query head -> retrieval row
        kr = ks if self.per_query_head else k  # [NR, S, D]
        if not self.oracle:
            cfg, ids, rows = self._summaries(layer, k)
            fdt = torch.float16 if dev.type == "cuda" else torch.float32
            onehot = one_hot_ids(ids, cfg, torch.int32)  # [Hkv, S, B·2^m]
            prefix = torch.cat([torch.zeros_like(onehot[:, :1]), torch.cumsum(onehot, 1, dtype=torch.int32)], 1)  # [Hkv, S+1, ..]
            onehot = onehot.to(fdt)[kv_of]  # [NR, S, B·2^m]
            rows = rows[kv_of].transpose(1, 2)  # [NR, D, S]
        j = torch.arange(s, device=dev)
        out = torch.empty(tq, hq, d, dtype=q.dtype, device=dev)
        chunk = max(1, (1 << (26 if dev.type == "cuda" else 22)) // max(1, hq * s))
        qg = None if self.per_query_head else group_queries(q, g)  # [Hkv, Tq, D] f64, the summed queries
        qf = q.float() if qg is None else qg.float()  # [NR, Tq, D], the exact top-k's queries
        rec_sum, rec_n = 0.0, 0
        for a in range(0, tq, chunk):
            z = slice(a, min(a + chunk, tq))
            qc, pc, s0c, rc, nc, tc = q[:, z], pos[z], s0[z], r_end[z], n_reg[z], retr[z]
            causal = j[None, :] <= pc[:, None]  # [Qc, S]
            region = (j[None, :] >= s0c[:, None]) & (j[None, :] < rc[:, None])
            kq = torch.where(tc, torch.clamp(nc, max=self.k), torch.zeros_like(nc)).expand(nr, -1)
            if self.head_max:  # the largest of the group's heads' exact scores
                exact = torch.matmul(qc.float(), ks.float().transpose(1, 2))
                exact = exact.reshape(nr, g, *exact.shape[1:]).amax(1)
            else:
                exact = torch.matmul(qf[:, z], kr.float().transpose(1, 2))  # [NR, Qc, S]
            oracle_sel = top_k_mask(exact, region.expand(nr, -1, -1), kq)
            del exact
            if self.oracle:
                sel = oracle_sel
            else:
                qrow = qc if qg is None else qg[:, z]
                sel = self._select(cfg, qrow, onehot, rows, prefix, kv_of, region, s0c, rc, nc, tc, qc if self.head_max else None, self.cache[layer])
                inter = (sel & oracle_sel).sum(-1).double()
                rows_r = tc.expand(nr, -1)
                rec_sum += float((inter / kq.clamp(min=1).double())[rows_r].sum())
                rec_n += int(rows_r.sum())
            sel = sel[row_of]  # [Hq, Qc, S]: a kv head's rows for each of its query heads
            allowed = torch.where(tc[None, :, None], (causal & ~region)[None] | sel, causal[None])
            del sel, oracle_sel
            logits = torch.matmul(qc, ks.transpose(1, 2)) * scaling
            logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
            w = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
            out[z] = torch.matmul(w, vs).transpose(0, 1)
        if rec_n:
            acc = self.recall.setdefault(layer, [0.0, 0])
            acc[0] += rec_sum
            acc[1] += rec_n
            self.stats["recall_vs_exact_topk_by_layer"][str(layer)] = acc[0] / acc[1]
        return out.contiguous()

    def _select(self, cfg, qc, onehot, rows, prefix, kv_of, region, s0c, rc, nc, tc, qheads=None, summaries=None):
        """The ParisKV top-k of each (retrieval row, position): ``[NR, Qc, S]`` bool, for the
        retrieval queries ``qc [NR, Qc, D]`` (a query head's, or a kv head's summed query).
        ``onehot [NR, S, B·2^m]``, ``rows [NR, D, S]``, ``kv_of [NR]`` the kv head of each row,
        ``prefix [Hkv, S+1, B·2^m]`` (the occupancy histogram of every key prefix)."""
        nr = qc.shape[0]
        tcl = tc.tolist()
        plans = [plan(n, self.k, self.dense_below, self.schedule) for n in nc.tolist()]
        rho = torch.tensor([p[0] for p in plans], dtype=torch.float64, device=qc.device)
        cands = torch.tensor([p[2] if t else 0 for p, t in zip(plans, tcl)], device=qc.device)
        kk = torch.tensor([p[3] if t else 0 for p, t in zip(plans, tcl)], device=qc.device)
        nrm, qr, order = prepare_queries(qc, cfg)  # [NR, Qc], [NR, Qc, D], [NR, Qc, B, 2^m]
        hist = (prefix[:, rc] - prefix[:, s0c]).reshape(prefix.shape[0], -1, cfg.b, cfg.cents)[kv_of]  # [NR, Qc, B, 2^m]
        bonus = bonuses(order, hist, nc.expand(nr, -1), rho.expand(nr, -1), cfg.tiers)
        scores = torch.bmm(bonus.reshape(nr, qc.shape[1], -1).to(onehot.dtype), onehot.transpose(1, 2)).round().long()  # [NR, Qc, S]
        cmask = top_c_mask(scores, region[None], cands.expand(nr, -1))
        del scores
        if qheads is None:
            est = torch.bmm(qr * nrm[..., None], rows)  # [NR, Qc, S] f64
        else:  # `head_max`: each of the g query heads' estimate, the largest per key
            g = qheads.shape[0] // nr
            nh, qh, _ = prepare_queries(qheads, cfg)
            est = torch.bmm(qh * nh[..., None], rows.repeat_interleave(g, 0))
            est = est.reshape(nr, g, *est.shape[1:]).amax(1)
        if self.whole64:
            est = est * self._whole_weights(summaries["logw"], summaries["valid"], kv_of, rc)
        return top_k_mask(est, cmask, kk.expand(nr, -1))

    def _whole_weights(self, logw, valid, kv_of, rc):
        """``[NR, Qc, S]`` f64 weights of the 64 B summaries (``logw``, ``valid`` ``[Hkv, S]``:
        :func:`summarize_whole`) for positions whose retrieval region ends at ``rc [Qc]``: each
        on the grid of that region (the prefill the position's cache holds, whose largest weight
        is the top code; the region starts at the sinks)."""
        j = torch.arange(logw.shape[1], device=logw.device)
        none = -(1 << 40)
        pm = torch.cummax(torch.where(valid & (j >= self.sinks), logw, torch.full_like(logw, none)), 1).values
        top = pm[:, (rc - 1).clamp(min=0)]  # [Hkv, Qc]
        base = torch.where(top > none, top - 255, torch.full_like(top, -128))
        _, val = whole_weights(logw[kv_of][:, None, :], valid[kv_of][:, None, :], base[kv_of][..., None])
        return val

    def bytes_per_token(self, d: int) -> float:
        return float(d // 2) if self.whole64 else float(Config(d, self.tiers).summary_bytes())

    def describe(self):
        return {"kind": "sim", "codec": "paris", "k": self.k, "sinks": self.sinks, "local": self.local,
                "dense_below": self.dense_below, "tiers": self.tiers, "oracle": self.oracle,
                "retrieval": "per query head" if self.per_query_head else ("per kv head, vote by the summed query, ranked by the largest head estimate"
                                                                           if self.head_max else "per kv head (summed query of the GQA group)"),
                "layout": "whole64 (64 B at d 128: whole-vector 4-bit codes, 8 coordinates on 3 bits, one 8-bit log weight per key)" if self.whole64 else "subspace4 (ids + 4-bit codes + fp16 weights per subspace)",
                "schedule": {"points_min_len_rho_beta": self.schedule, "min_candidates_per_k": MIN_CANDIDATES_PER_K},
                "semantics": "every query position decoded with retrieval (causal, teacher forced): sinks + local + top-k of "
                             "the retrieval region, exact fp16 K/V, one softmax (benches/quality/paris_sim.py)",
                "bytes_source": "computed: GPU-resident summaries per retrieval-region key (" + ("D/2 bytes" if self.whole64 else "ids + 4-bit codes + fp16 weights")
                                + "); the fp16 K/V stay in pinned host memory, sinks + local on the GPU",
                "stats": self.stats}
