"""transformers integration: run a model's attention on kvforge's compressed KV cache.

::

    import torch, kvforge.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16).cuda().eval()
    kv = kvforge.hf.use_kvforge(model, spec="specs/rdkv.toml", tier="b4")
    out = model.generate(**tok(prompts, return_tensors="pt", padding=True).to("cuda"), max_new_tokens=32)
    kv.bytes_per_token()                                    # resident bytes / token / kv head

``use_kvforge`` registers an attention function (and a mask function that builds no mask:
kvforge applies the causal structure itself) with transformers' ``AttentionInterface`` under
the name ``"kvforge"`` and points ``model.config._attn_implementation`` at it. Every attention
layer then keeps one :class:`kvforge.Cache` (its kv heads, its GQA group) with one sequence
per batch row, holding that row's real tokens only (left padding is skipped: the mask function
passes the 2D padding mask through). A prompt (queries covering every key: a new text,
``use_cache=False`` or a fresh ``generate``) is attended exactly with torch SDPA on the fresh
K/V, as a serving prefill does, and its post-RoPE K/V are written into the cache on the GPU
(``Cache.append_device``: full pages encoded into ``tier`` in one launch, no host copy); each
decode step writes every row's new token in one launch (``Cache.append_step``) and answers
the batch's queries with one ``decode`` on what is stored. ``prefill="cache"`` attends a
prompt on the compressed cache instead (``attend_prefix``), so that the prompt's own loss
measures the tier. A new prompt empties the layer's cache (its sequences removed, the pool
and loaded kernels kept); specs whose caches carry state set from a prompt (spherical radius
scales, TriZone channel orders) and runs with a controller or certifier get a new cache, so
that state never leaks from one text into the next.

Controllers and certificates (``use_kvforge(..., control=Control("rdr", budget=64.0))`` or
``certify=kvforge.Certifier()``): with a controller, a prompt is attended exactly (as a
serving system's prefill reads the fresh fp16 K/V), and each layer's controller then moves the
cache's pages down the spec's ladder (re-code, drop) to the byte budget, weighing tokens by the
prompt's attention column sums ``Σ_τ a_τt`` (seed 002's token weights, summed over the GQA
group); later tokens attend what the controller left. With a certifier, decode steps (one query
token) run certified decode (seed 004) and each layer's per-head certificates are kept in
``handle.certificates``; the cache keeps its fp16 originals in pinned host memory for that.
``handle.reports`` holds each layer's last :class:`kvforge.ControlReport`.

Spherical tiers (``specs/spherical.toml``) ship one placeholder codebook trained on uniform
random unit vectors, which does not fit real keys (docs/quality.md, "Spherical keys on real
keys"); ``use_kvforge(..., codebooks="sph-g16b6.safetensors")`` gives every layer's cache its
own per-(kv head, group) codebooks from ``kvforge codebook train --per-head`` (a path or a
:class:`kvforge.Codebooks`), set on every spherical tier whose group and codeword count match
the file. A spherical tier left on the placeholder raises a ``UserWarning`` once per handle.

Limits: padding on the left (other padding patterns are gathered row by row, slower);
``control``/``certify`` run batch 1; the new tokens of a decode step are real (as in
``generate``); inference only (no dropout, no gradients through the cache), no sliding window
or logit soft-capping; tensors on CUDA in the spec's dtype (load
the model with ``dtype=torch.float16`` for the shipped specs). transformers still keeps its
own fp16 KV cache during ``generate``; kvforge's cache holds the compressed copy the
attention reads.

Decode steps through :func:`generate` (instead of ``model.generate``) hand each layer the new
token's key/value only (:class:`PassKV`: transformers keeps no KV copy) and make one
``Cache.step`` call per layer; ``cuda_graph=True`` captures the whole decode step as one CUDA
graph and replays it (``Cache.graph_prepare`` / ``graph_launch`` / ``graph_commit``).
:func:`score` runs the same steps teacher-forced and returns each next token's NLL: the
perplexity of a text decoded token by token on the cache, window policy included::

    kvforge.hf.use_kvforge(model, spec="specs/rotated.toml", tier="r3", sink_pages=1, recent_pages=2, cuda_graph=True)
    nll = kvforge.hf.score(model, ids, prefix=64)   # ids [B, S]; nll [B, S - 64]
    ppl = nll.mean().exp()

``import kvforge.hf`` needs neither torch nor transformers; they are imported when used.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = [
    "ATTN_NAME",
    "Control",
    "KvforgeAttention",
    "attach",
    "attention_function",
    "bytes_per_token",
    "generate",
    "score",
    "handle_of",
    "no_mask",
    "PassKV",
    "prompt_positions",
    "register",
    "row_spans",
    "sdpa_causal",
    "use_kvforge",
]

ATTN_NAME = "kvforge"
_HANDLE_ATTR = "_kvforge_attention"


class Control:
    """A tier controller for every layer: ``kvforge.Controller(cache, policy, budget=..., **kw)``
    is made per layer cache and applied once after each prompt. ``budget`` is bytes per token
    per kv head (``per="token"``) unless ``kw`` says otherwise; see :class:`kvforge.Controller`.

    The controller weighs each token by the prompt's exact attention to it, summed over the
    prompt's queries; ``observe=n`` sums over its last ``n`` queries only (SnapKV's observation
    window: a question at the end of the prompt then decides which pages keep their bytes).
    ``observe_weight=w`` (with ``observe``) mixes the two: ``w`` × the window's sums + (1 − w) ×
    the whole prompt's, scaled to the window's query count, so that the pages the question reads
    and the pages the text leans on both keep their bytes (1, the default: the window alone).
    ``keep=k`` (with ``observe``) gives the ``k`` positions per kv head that the window attends
    most a weight equal to the head's whole mass, so their pages rank above every other page
    and keep the highest tier the budget allows (SnapKV's selection, applied to precision).
    ``share=k`` (with ``observe``) shares that selection across layers: the pages holding a
    token within ``share_radius`` positions of any layer's and kv head's ``k`` top window
    positions weigh the head's whole mass in every layer and head (each of their tokens
    total ÷ page tokens). The controllers then run once the prompt has passed every layer, when
    the next forward pass starts (or on :meth:`KvforgeAttention.flush_control`); see
    docs/quality.md ("The depth-0.2 needle traced on the CPU") for why."""

    def __init__(self, policy: str = "rdr", budget: float = 64.0, observe: Optional[int] = None,
                 observe_weight: float = 1.0, keep: int = 0, share: int = 0, share_radius: int = 0, **kw: Any):
        if observe is not None and (isinstance(observe, bool) or not isinstance(observe, int) or observe < 1):
            raise ValueError(f"kvforge.hf.Control: observe must be a positive integer or None, got {observe!r}")
        if isinstance(observe_weight, bool) or not isinstance(observe_weight, (int, float)) or not 0.0 <= observe_weight <= 1.0:
            raise ValueError(f"kvforge.hf.Control: observe_weight must be a number in [0, 1], got {observe_weight!r}")
        self.policy, self.budget, self.observe, self.kw = policy, float(budget), observe, dict(kw)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"kvforge.hf.Control: keep must be a non-negative integer, got {keep!r}")
        if keep and observe is None:
            raise ValueError("kvforge.hf.Control: keep needs observe (the window that picks the positions)")
        for name, n in (("share", share), ("share_radius", share_radius)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"kvforge.hf.Control: {name} must be a non-negative integer, got {n!r}")
        if share and observe is None:
            raise ValueError("kvforge.hf.Control: share needs observe (the window that picks the positions)")
        if share_radius and not share:
            raise ValueError("kvforge.hf.Control: share_radius needs share")
        self.observe_weight, self.keep, self.share, self.share_radius = float(observe_weight), keep, share, share_radius

    def make(self, kvforge, cache):
        return kvforge.Controller(cache, policy=self.policy, budget=self.budget, **self.kw)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.kw.items())
        obs = "" if self.observe is None else f", observe={self.observe}"
        if self.observe is not None and self.observe_weight != 1.0:
            obs += f", observe_weight={self.observe_weight}"
        if self.keep:
            obs += f", keep={self.keep}"
        if self.share:
            obs += f", share={self.share}, share_radius={self.share_radius}"
        return f"Control({self.policy!r}, budget={self.budget}{obs}{extra})"


def exact_attention(q, k, v, scaling: float, chunk: int = 1024, column_sums: bool = True, observe: Optional[int] = None,
                    observe_weight: float = 1.0, keep: int = 0, return_window: bool = False):
    """Exact causal attention in fp32 with the queries at the last ``Tq`` of ``S`` positions,
    and the attention column sums: q [Hq, Tq, D], k/v [Hkv, S, D] -> (out [Tq, Hq, D] in q's
    dtype, mass [Hkv, S] float64 = Σ over queries and the kv head's GQA group of a_τt, or None
    with ``column_sums=False``); ``observe=n`` sums over the last ``n`` queries only, or with
    ``observe_weight=w < 1`` returns ``w`` × those sums + (1 − w) × min(n, Tq) / Tq × the sums
    over every query, and ``keep=k`` raises the ``k`` positions per kv head with the largest window
    sums to that head's total (see :class:`Control`); ``return_window=True`` adds the window's
    own sums as a third result. Queries are processed ``chunk`` at a time (memory Hq × chunk × S
    × 4 bytes)."""
    import torch

    hq, tq, d = q.shape
    hkv, s, _ = k.shape
    g = hq // hkv
    kf, vf = k.float(), v.float()
    qg = q.float().reshape(hkv, g, tq, d)
    out = torch.empty(tq, hq, d, dtype=q.dtype, device=q.device)
    mass = torch.zeros(hkv, s, dtype=torch.float64, device=q.device) if column_sums else None
    mix = column_sums and observe is not None and observe_weight < 1.0
    whole = torch.zeros(hkv, s, dtype=torch.float64, device=q.device) if mix else None
    cols = torch.arange(s, device=q.device)
    for i0 in range(0, tq, chunk):
        i1 = min(tq, i0 + chunk)
        sc = torch.einsum("hgtd,hsd->hgts", qg[:, :, i0:i1], kf) * scaling
        pos = torch.arange(i0, i1, device=q.device) + (s - tq)
        sc = sc.masked_fill(cols[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(sc, dim=-1)
        out[i0:i1] = torch.einsum("hgts,hsd->thgd", p, vf).reshape(i1 - i0, hq, d).to(q.dtype)
        if mass is not None:
            lo = 0 if observe is None else max(0, tq - observe - i0)
            if lo < i1 - i0:
                mass += p[:, :, lo:].sum(dim=(1, 2)).double()
            if whole is not None:
                whole += p.sum(dim=(1, 2)).double()
    window = mass
    if whole is not None:
        mass = observe_weight * mass + (1.0 - observe_weight) * (min(observe, tq) / tq) * whole
    if mass is not None and observe is not None and keep > 0:
        top = window.topk(min(keep, s), dim=1).indices
        mass = mass.scatter(1, top, mass.sum(dim=1, keepdim=True).expand(-1, top.shape[1]))
    if return_window:
        return out, mass, window
    return out, mass


def shared_pages(windows, k: int, radius: int, page_tokens: int) -> List[int]:
    """Pages (index = position // ``page_tokens``) holding a position within ``radius`` of any of
    the ``k`` largest sums of any window in ``windows`` (each ``[Hkv, S]``, one per layer, the
    same ``S``), ascending: :class:`Control`'s ``share``."""
    pages = set()
    for w in windows:
        s = w.shape[1]
        for t in w.topk(min(k, s), dim=1).indices.flatten().tolist():
            pages.update(range(max(0, t - radius) // page_tokens, min(s - 1, t + radius) // page_tokens + 1))
    return sorted(pages)


def share_mass(mass, pages: List[int], page_tokens: int):
    """``mass`` ``[Hkv, S]`` with every token of ``pages`` at its head's total ÷ ``page_tokens``
    (a whole page then weighs the head's total)."""
    out = mass.clone()
    total = mass.sum(dim=1)
    for pg in pages:
        out[:, pg * page_tokens:(pg + 1) * page_tokens] = (total / page_tokens)[:, None]
    return out


def channel_order(q, k) -> List[int]:
    """Seed 002 Prop. 3.2 channel weights ``w_c = ‖Q[:,c]‖ ‖K[:,c]‖ / √d`` per kv head (the
    queries of its GQA group against its keys) and each head's channels heaviest first (ties
    by channel index) — the order a mixed-key (TriZone) tier stores them in, so that its widest
    segments hold the heaviest channels. ``q [Hq, Tq, D]``, ``k [Hkv, S, D]``; returns
    ``Hkv * D`` ints for ``Cache.set_channel_order``."""
    hq, _, d = q.shape
    hkv = k.shape[0]
    qn = q.double().reshape(hkv, -1, d).norm(dim=1)  # [Hkv, D]: the group's queries stacked
    kn = k.double().norm(dim=1)                       # [Hkv, D]
    w = (qn * kn / math.sqrt(d)).tolist()
    order: List[int] = []
    for row in w:
        order.extend(sorted(range(d), key=lambda c: (-row[c], c)))
    return order


def sdpa_causal(q, k, v, scaling: float):
    """Causal attention of a prompt on its own fresh K/V with torch SDPA in the model dtype (a
    serving prefill): ``q [B, Hq, T, D]``, ``k, v [B, Hkv, T, D]`` -> ``[B, T, Hq, D]``."""
    import torch

    f = torch.nn.functional.scaled_dot_product_attention
    g = q.shape[1] // k.shape[1]
    if g > 1:
        try:
            o = f(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        except TypeError:  # torch < 2.5: no enable_gqa
            o = f(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True, scale=scaling)
    else:
        o = f(q, k, v, is_causal=True, scale=scaling)
    return o.transpose(1, 2)


def row_spans(rows: List[List[Any]]) -> List[Tuple[int, Optional[List[int]]]]:
    """Per row of a padding mask (truthy = a real token), where its real tokens are:
    ``(start, None)`` when they are the contiguous run ``start .. len(row) - 1`` (no padding, or
    left padding: ``start`` pads), else ``(count, positions)``. Pure Python, so that it is tested
    without torch."""
    out: List[Tuple[int, Optional[List[int]]]] = []
    for r in rows:
        pos = [j for j, x in enumerate(r) if x]
        start = len(r) - len(pos)
        if pos == list(range(start, len(r))):
            out.append((start, None))
        else:
            out.append((len(pos), pos))
    return out


def real_positions(span: Tuple[int, Optional[List[int]]], s: int) -> List[int]:
    """The real positions of one row (a :func:`row_spans` entry over ``s`` positions)."""
    first, pos = span
    return list(range(first, s)) if pos is None else pos


PREFILL_MODES = ("sdpa", "exact", "cache")


class KvforgeAttention:
    """Per-model state: one ``kvforge.Cache`` per attention layer, one sequence in it per batch row.

    ``attend_batch(layer, q, k, v, scaling, mask)`` takes a batch as transformers' attention
    layers hold it: ``q [B, Hq, Tq, D]`` (the last ``Tq`` positions), ``k, v [B, Hkv, S, D]``
    (post-RoPE, every position so far), ``mask`` None or a ``[B, S]`` padding mask (True: a real
    token), and returns ``[B, Tq, Hq, D]``. Each row is its own sequence in the cache, holding
    its real tokens only (padding free); rows at padded query positions come back zero.
    ``attend(layer, q, k, v, scaling)`` is one row without padding: ``q [Hq, Tq, D]``, ``k, v
    [Hkv, S, D]`` -> ``[Tq, Hq, D]``.

    ``prefill`` says how a new prompt's queries (they cover every key) are answered: ``"sdpa"``
    attends them exactly with torch SDPA in the model dtype on the fresh K/V, as a serving
    prefill does; ``"exact"`` in fp32 with the attention column sums a controller weighs
    (:func:`exact_attention`); ``"cache"`` attends the compressed cache (``attend_prefix``),
    so the prompt's own loss measures the tier. Either way the prompt's K/V are stored compressed
    for the tokens that follow. Default: ``"exact"`` with ``control`` or ``exact_prefill``, else
    ``"cache"``.

    ``sink_pages``, ``recent_pages``: the caches' window policy (``kvforge.Cache``): each
    sequence's first ``sink_pages`` pages and its ``recent_pages`` newest full pages stay fp16
    (the tail format) and only older pages are coded into ``tier``. Default 0, 0 (every page
    coded as it fills); low-bit rotated tiers need it (docs/quality.md: ``sink_pages=1,
    recent_pages=2`` at 64-token pages, 64 sink tokens and a 128-191-token window, takes
    ``r3`` to within 1% of fp16 perplexity on SmolLM2).
    """

    def __init__(self, spec: str = "specs/rdkv.toml", tier: Optional[str] = "b4", root: Optional[str] = None,
                 max_tokens: int = 8192 + 256, module: Any = None, control: Optional[Control] = None,
                 certify: Any = None, exact_prefill: bool = False, codebooks: Any = None, prefill: Optional[str] = None,
                 sink_pages: int = 0, recent_pages: int = 0):
        # The extension is looked up when a handle is made, not when this file is imported:
        # ``import kvforge.hf`` works without a GPU, torch or transformers.
        self.kvforge = module if module is not None else importlib.import_module("kvforge")
        self.spec, self.tier = spec, tier
        self.root = None if root is None else str(root)
        self.max_tokens = int(max_tokens)
        for name, n in (("sink_pages", sink_pages), ("recent_pages", recent_pages)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"kvforge.hf: {name} must be a non-negative integer, got {n!r}")
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        if control is not None and (sink_pages or recent_pages):
            raise ValueError("kvforge.hf: a controller keeps its own sinks and recent pages "
                             "(Control(..., sinks=, recent=), in the tier pages start in: for an fp16 window "
                             "under a controller start them in an fp16 tier, e.g. specs/rotated.toml's r16); "
                             "sink_pages / recent_pages need control=None")
        if certify is not None and (sink_pages or recent_pages):
            raise ValueError("kvforge.hf: certified decode does not cover a window policy's fp16 pages; "
                             "sink_pages / recent_pages need certify=None")
        # layer -> {"cache", "seqs" (one per row), "seq" (row 0's), "n" (positions seen), "rows", "cap"}
        self.layers: Dict[int, Dict[str, Any]] = {}
        # Control(share=): layer -> (cache, seq, mass, window) of a prompt whose controllers wait
        # for the prompt's last layer (flush_control).
        self._pending: Dict[int, Tuple[Any, Any, Any, Any]] = {}
        # A controller decides from an exact prefill's attention; so can a caller who asks.
        self.control, self.certify = control, certify
        if prefill is None:
            prefill = "exact" if (exact_prefill or control is not None) else "cache"
        if prefill not in PREFILL_MODES:
            raise ValueError(f"kvforge.hf: prefill={prefill!r}; expected one of {', '.join(PREFILL_MODES)}")
        if control is not None and prefill != "exact":
            raise ValueError(f"kvforge.hf: a controller weighs the prompt's exact attention (prefill='exact'), got prefill={prefill!r}")
        self.prefill = prefill
        self.exact_prefill = prefill != "cache"
        self.reports: Dict[int, Any] = {}       # layer -> last kvforge.ControlReport
        self.certificates: Dict[int, Any] = {}  # layer -> [kvforge.HeadCertificate] of the last step
        # Per-(layer, kv head, group) spherical codebooks, a path or a kvforge.Codebooks.
        if codebooks is not None and not hasattr(codebooks, "layer"):
            codebooks = self.kvforge.Codebooks(str(codebooks))
        self.codebooks = codebooks
        self._warned_placeholder = False
        self._spans: Tuple[Any, Any] = (None, None)  # (the last padding mask, its row_spans)
        # Set by :func:`generate` for its decode steps: each layer's key/value hold the step's
        # own token only (no transformers cache), ``_stream`` is torch's current stream handle
        # (looked up once per step, not per layer), ``_capture`` the stream a CUDA graph is
        # being captured on (the layers then launch there through ``Cache.graph_launch``).
        self._step_mode = False
        self._stream: Optional[int] = None
        self._capture: Optional[int] = None
        self.cuda_graph = False
        # layer -> (out, lse) of decode steps, kept across prompts (a captured graph writes them)
        self._bufs: Dict[int, Tuple[Any, Any]] = {}
        # batch rows -> the last generate()'s captured step, replayed again while its keys hold
        self._graphs: Dict[int, Any] = {}

    def reset(self) -> None:
        """Forget every sequence (dropping the caches frees their GPU memory)."""
        self._step_mode, self._stream, self._capture = False, None, None
        self._graphs, self._bufs = {}, {}
        self.layers = {}
        self._pending = {}
        self.reports, self.certificates = {}, {}
        self._spans = (None, None)

    def _reusable(self, st: Optional[Dict[str, Any]], rows: int, s: int) -> bool:
        """Whether a layer's cache can take a new prompt of ``rows`` rows of up to ``s`` tokens
        after its sequences are removed: per-cache state set from a prompt (spherical radius
        scales, TriZone channel orders, kept originals, a controller's re-tiering) must not leak
        into the next, and the pool must be large enough."""
        if st is None or self.control is not None or self.certify is not None or not hasattr(st["cache"], "remove_sequence"):
            return False
        c = st["cache"]
        if getattr(c, "spherical_tiers", None) or list(getattr(c, "mixed_key_tiers", ())):
            return False
        return rows <= st["cap"] and s <= st["max_tokens"]

    def _new_sequences(self, layer: int, q, k, rows: int) -> Dict[str, Any]:
        """Sequences for a new prompt of ``rows`` rows: the layer's cache emptied where it can be
        reused (no allocation, kernels already loaded), else a new cache."""
        s = k.shape[-2]
        old = self.layers.get(layer)
        if self._reusable(old, rows, s):
            cache, cap, max_tokens = old["cache"], old["cap"], old["max_tokens"]
            for seq in old["seqs"]:
                cache.remove_sequence(seq)
        else:
            cache, cap, max_tokens = self._new_cache(layer, q, k, rows), rows, max(self.max_tokens, s)
        seqs = [cache.add_sequence() for _ in range(rows)]
        st = {"cache": cache, "seqs": seqs, "seq": seqs[0], "n": 0, "rows": rows, "cap": cap, "max_tokens": max_tokens}
        self.layers[layer] = st
        return st

    def _new_cache(self, layer: int, q, k, rows: int = 1):
        hq, d = q.shape[-3], q.shape[-1]
        hkv, s = k.shape[-3], k.shape[-2]
        per_row = max(self.max_tokens, s)
        kw = dict(head_dim=d, num_kv_heads=hkv, gqa=hq // hkv, max_tokens=per_row * rows, target=self.tier,
                  root=self.root)
        if rows > 1:
            kw["sequences"] = rows
        if self.sink_pages or self.recent_pages:
            kw["sink_pages"], kw["recent_pages"] = self.sink_pages, self.recent_pages
        if self.control is None and self.certify is None:
            # Pages of the tail and the target tier only: nothing re-tiers without a controller.
            kw["target_only"] = True
        index = getattr(getattr(q, "device", None), "index", None)
        if index:  # device 0 is the Cache's default
            kw["device"] = index
        cache = self.kvforge.Cache(self.spec, **kw)
        mixed = list(getattr(cache, "mixed_key_tiers", ()))
        if mixed:  # TriZone: order each head's channels by the prompt's weights before coding
            qq, kk = (q[0], k[0]) if q.dim() == 4 else (q, k)
            order = channel_order(qq, kk)
            for t in mixed:
                cache.set_channel_order(t, order)
        self._set_codebooks(layer, cache)
        if self.certify is not None:
            cache.keep_originals()
        return cache

    def _set_codebooks(self, layer: int, cache) -> None:
        """Gives ``cache`` layer ``layer``'s codebooks on every spherical tier they fit;
        warns once when a spherical tier is left on the spec's uniform placeholder."""
        cb = self.codebooks
        if cb is not None:
            tiers = getattr(cache, "spherical_tiers", {})
            fits = [t for t, (group, entries) in tiers.items() if (group, entries) == (cb.group, cb.entries)]
            if not fits:
                raise ValueError(f"kvforge.hf: codebooks {cb!r} fit no spherical tier of {self.spec} (group and codeword count must match)")
            for t in fits:
                cache.set_codebook(t, cb, layer=layer)
        left = list(getattr(cache, "placeholder_codebook_tiers", ()))
        if left and not self._warned_placeholder:
            self._warned_placeholder = True
            warnings.warn(f"kvforge.hf: spherical tier(s) {', '.join(left)} of {self.spec} use the uniform placeholder codebook "
                          "(trained on random unit vectors, not keys): expect a large quality loss. Train per-head codebooks on "
                          "the model's keys (kvforge codebook train --per-head) and pass codebooks=", UserWarning, stacklevel=3)

    def _row_spans(self, mask, rows: int, s: int) -> List[Tuple[int, Optional[List[int]]]]:
        """:func:`row_spans` of ``mask`` (one host copy per mask: every layer of a forward gets
        the same mask object), or every position real without one."""
        if mask is None:
            return [(0, None)] * rows
        if self._spans[0] is not mask:
            self._spans = (mask, row_spans(mask[:, -s:].tolist()))
        return self._spans[1]

    def attend(self, layer: int, q, k, v, scaling: float):
        check_shapes(q, k, v)
        return self.attend_batch(layer, q[None], k[None], v[None], scaling)[0]

    def attend_batch(self, layer: int, q, k, v, scaling: float, mask=None):
        if mask is not None and mask.dim() == 2 and mask.shape[-1] > k.shape[-2]:
            mask = mask[:, -k.shape[-2]:]  # a mask over more positions than the keys: the last ones
        check_batch_shapes(q, k, v, mask)
        if layer in self._pending:
            self.flush_control()  # the prompt has passed every layer: its controllers run now
        rows, hq, tq, d = q.shape
        s = k.shape[2]
        if rows > 1 and (self.control is not None or self.certify is not None):
            raise ValueError(f"kvforge.hf: control= and certify= run batch 1, got batch {rows}")
        st = self.layers.get(layer)
        if self._step_mode and st is not None and tq == 1 and s == 1 and st["rows"] == rows and st["n"] > 0:
            # generate()'s decode step: key/value hold the new token only.
            qs = q * (scaling * math.sqrt(d)) if abs(scaling * math.sqrt(d) - 1.0) > 1e-6 else q
            return self._decode_step(layer, st, qs, k, v, st["n"] + 1)
        # a new prompt: other rows, fewer positions than seen, or queries for all of them
        prompt = st is None or st["rows"] != rows or st["n"] > s or (tq == s and st["n"] > 0)
        if prompt:
            st = self._new_sequences(layer, q, k, rows)
        cache, seqs = st["cache"], st["seqs"]
        if abs(scaling * math.sqrt(d) - 1.0) > 1e-6:  # kvforge scales scores by 1/sqrt(d)
            qs = q * (scaling * math.sqrt(d))
        else:
            qs = q
        if not prompt and tq == 1 and s == st["n"] + 1:
            # A decode step: every row's one new token (real: generate extends the mask by ones),
            # written on the device in one launch, then one decode launch for the batch.
            return self._decode_step(layer, st, qs, k, v, s)
        spans = self._row_spans(mask, rows, s)
        n0 = st["n"]
        append = getattr(cache, "append_device", None) or cache.append
        for b, seq in enumerate(seqs):  # the real tokens not seen yet, [T, Hkv, D]
            first, pos = spans[b]
            if pos is None:
                lo = max(first, n0)
                if lo < s:
                    append(seq, k[b, :, lo:].transpose(0, 1).contiguous(), v[b, :, lo:].transpose(0, 1).contiguous())
            else:
                new = [p for p in pos if p >= n0]
                if new:
                    idx = self._index(new, k.device)
                    append(seq, k[b].index_select(1, idx).transpose(0, 1).contiguous(), v[b].index_select(1, idx).transpose(0, 1).contiguous())
        st["n"] = s
        if prompt and tq == s and self.prefill != "cache":
            return self._exact_prompt(layer, cache, seqs, spans, q, k, v, scaling)
        return self._attend_cache(cache, seqs, spans, qs, s)

    def _outputs(self, layer: int, q):
        """The layer's decode outputs (out [B, Hq, D], lse [B, Hq] float32), made once per
        batch shape and reused every step and prompt: the model consumes a layer's output
        before the layer's next step writes it (one stream), and a captured graph keeps
        writing the same ones."""
        import torch

        rows, hq, _, d = q.shape
        bufs = self._bufs.get(layer)
        if bufs is None or tuple(bufs[0].shape) != (rows, hq, d) or bufs[0].dtype != q.dtype or bufs[0].device != q.device:
            bufs = (torch.empty(rows, hq, d, dtype=q.dtype, device=q.device), torch.empty(rows, hq, dtype=torch.float32, device=q.device))
            self._bufs[layer] = bufs
            self._graphs = {}  # graphs captured with the old buffers write those
        return bufs

    def _decode_step(self, layer: int, st: Dict[str, Any], qs, k, v, n: int):
        """One token per row: appended and attended in one call where the cache has ``step``
        (``graph_launch`` while a CUDA graph is being captured), else ``append_step`` then
        ``decode``. ``n``: the positions seen after the step."""
        cache, seqs = st["cache"], st["seqs"]
        kk, vv = k[:, :, -1].contiguous(), v[:, :, -1].contiguous()
        qq = qs[:, :, 0].contiguous()
        if self._capture is None:  # a captured step is counted by each replay's graph_commit
            st["n"] = n
        if self.certify is None and hasattr(cache, "step"):
            out, lse = self._outputs(layer, qs)
            if self._capture is not None:
                cache.graph_launch(seqs, kk, vv, qq, out, lse, self._capture)
            else:
                cache.step(seqs, kk, vv, qq, out=out, lse=lse, stream=self._stream)
            return out.unsqueeze(1)
        step = getattr(cache, "append_step", None)
        if step is not None:
            step(seqs, kk, vv)
        else:  # a cache object without device appends (tests' stand-ins)
            for i, seq in enumerate(seqs):
                cache.append(seq, kk[i:i + 1], vv[i:i + 1])
        if self.certify is not None:
            out, _, self.certificates[layer] = self.certify.decode(cache, qq, seqs)
        else:
            out, _ = cache.decode(qq, seqs=seqs)
        return out.unsqueeze(1)

    @staticmethod
    def _index(positions: List[int], device):
        import torch

        return torch.tensor(positions, dtype=torch.long, device=device)

    def _exact_prompt(self, layer: int, cache, seqs, spans, q, k, v, scaling: float):
        """A new prompt's queries attended exactly on the fresh K/V, row by row where rows are
        padded; the controller (batch 1) then re-tiers the stored prompt."""
        import torch

        rows, hq, s, d = q.shape
        if self.prefill == "exact":
            out = torch.zeros(rows, s, hq, d, dtype=q.dtype, device=q.device)
            for b, seq in enumerate(seqs):
                first, pos = spans[b]
                if pos is not None:
                    raise ValueError("kvforge.hf: prefill='exact' takes left padding only (real tokens at the end of each row)")
                if first == s:
                    continue
                ctl = self.control
                o, mass, window = exact_attention(q[b, :, first:], k[b, :, first:], v[b, :, first:], scaling, column_sums=ctl is not None,
                                                  observe=None if ctl is None else ctl.observe,
                                                  observe_weight=1.0 if ctl is None else ctl.observe_weight,
                                                  keep=0 if ctl is None else ctl.keep, return_window=True)
                out[b, first:] = o
                if ctl is not None and ctl.share:
                    self._pending[layer] = (cache, seq, mass, window)
                elif ctl is not None:
                    self.reports[layer] = ctl.make(self.kvforge, cache).apply(cache, seq, token_mass=mass)
            return out
        if all(sp == (0, None) for sp in spans):
            return sdpa_causal(q, k, v, scaling)
        out = torch.zeros(rows, s, hq, d, dtype=q.dtype, device=q.device)
        for b in range(rows):
            first, pos = spans[b]
            if pos is None:
                if first < s:
                    out[b, first:] = sdpa_causal(q[b:b + 1, :, first:], k[b:b + 1, :, first:], v[b:b + 1, :, first:], scaling)[0]
            elif pos:
                idx = self._index(pos, q.device)
                sel = lambda x: x[b:b + 1].index_select(2, idx)  # noqa: E731
                out[b].index_copy_(0, idx, sdpa_causal(sel(q), sel(k), sel(v), scaling)[0])
        return out

    def _attend_cache(self, cache, seqs, spans, qs, s: int):
        """Queries on the cache as stored (``attend_prefix``, causal per row): the query at a real
        position p attends the row's real tokens up to p; padded query positions give zeros."""
        import torch

        rows, hq, tq, d = qs.shape
        out = torch.zeros(rows, tq, hq, d, dtype=qs.dtype, device=qs.device)
        for b, seq in enumerate(seqs):
            real = real_positions(spans[b], s)
            cut = s - tq
            at = {p: i + 1 for i, p in enumerate(real)}  # position -> real tokens up to it
            qpos = [p for p in real if p >= cut]
            if not qpos:
                continue
            lengths = [at[p] for p in qpos]
            if qpos == list(range(qpos[0], s)):
                qq = qs[b, :, qpos[0] - cut:].transpose(0, 1).contiguous()
                o, _ = cache.attend_prefix(seq, qq, lengths)
                out[b, qpos[0] - cut:] = o
            else:
                idx = self._index([p - cut for p in qpos], qs.device)
                qq = qs[b].index_select(1, idx).transpose(0, 1).contiguous()
                o, _ = cache.attend_prefix(seq, qq, lengths)
                out[b].index_copy_(0, idx, o)
        return out

    def flush_control(self) -> None:
        """Runs the controllers a prompt's layers left waiting (``Control(share=)``): the pages
        of the window's top positions of every layer and kv head (:func:`shared_pages`) weigh
        their head's whole mass in every layer, then each layer's controller applies. Called by
        the next forward pass and by the reports; a no-op when nothing waits."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        ctl = self.control
        page = next(iter(pending.values()))[0].page_tokens
        pages = shared_pages([w for _, _, _, w in pending.values()], ctl.share, ctl.share_radius, page)
        for layer, (cache, seq, mass, _) in sorted(pending.items()):
            self.reports[layer] = ctl.make(self.kvforge, cache).apply(cache, seq, token_mass=share_mass(mass, pages, page))

    def bytes_per_token(self) -> float:
        """Resident bytes per token of the context per kv head (page headers and the fp16 tail
        page included, dropped positions counted: :func:`context_bytes`), mean over layers, of
        what the caches hold now; NaN before the first forward."""
        self.flush_control()
        vals = [context_bytes(st["cache"], st["seqs"]) for _, st in sorted(self.layers.items())]
        return sum(vals) / len(vals) if vals else float("nan")

    @property
    def last_bytes(self) -> Dict[int, float]:
        """:func:`context_bytes` of every layer's cache, computed when asked (not per step)."""
        self.flush_control()
        return {layer: context_bytes(st["cache"], st["seqs"]) for layer, st in sorted(self.layers.items())}

    def memory_report(self) -> Dict[int, Any]:
        """``Cache.memory_report()`` of every layer's cache."""
        self.flush_control()
        return {layer: st["cache"].memory_report() for layer, st in sorted(self.layers.items())}

    def describe(self) -> Dict[str, Any]:
        return {"kind": "kvforge", "spec": self.spec, "tier": self.tier, "prefill": self.prefill,
                "sink_pages": self.sink_pages, "recent_pages": self.recent_pages,
                "kvforge_version": getattr(self.kvforge, "__version__", "?")}


def context_bytes(cache, seq) -> float:
    """Resident bytes of ``cache`` per logical token of ``seq`` (an id or a list of ids: the
    cache holds no others) per kv head (page headers, the fp16 tail page and padding included;
    dropped positions count as tokens, so eviction lowers it). For a cache without drops this
    equals ``cache.bytes_per_token()``."""
    seqs = [seq] if isinstance(seq, int) else list(seq)
    n = sum(cache.seq_len(s) for s in seqs) * cache.num_kv_heads
    return sum(u["resident_bytes"] for u in cache.memory_report()) / n if n else 0.0


def check_shapes(q, k, v) -> None:
    """One sequence's q [Hq, Tq, D], k/v [Hkv, S, D]: same dtype and device, S >= Tq, Hq a
    multiple of Hkv. kvforge itself refuses a dtype other than the spec's and host tensors."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"kvforge attention: q, k, v must be [heads, tokens, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    hq, tq, d = q.shape
    hkv, s, dk = k.shape
    if tuple(v.shape) != (hkv, s, dk) or dk != d:
        raise ValueError(f"kvforge attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"kvforge attention: {hq} query heads are not a multiple of {hkv} kv heads")
    if tq > s:
        raise ValueError(f"kvforge attention: {tq} queries but only {s} keys")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"kvforge attention: q {q.dtype}, k {k.dtype}, v {v.dtype} must share one dtype")


def check_batch_shapes(q, k, v, mask=None) -> None:
    """A batch: q [B, Hq, Tq, D], k/v [B, Hkv, S, D], mask None or [B, S]; per row as
    :func:`check_shapes`."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"kvforge attention: q, k, v must be [batch, heads, tokens, head_dim] with one batch, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    check_shapes(q[0], k[0], v[0])
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (k.shape[0], k.shape[2])):
        raise ValueError(f"kvforge attention: the padding mask must be [batch, keys] = {(k.shape[0], k.shape[2])}, "
                         f"got {tuple(mask.shape)}")


def _handle_of(module):
    h = getattr(module, _HANDLE_ATTR, None)
    if h is None:
        raise RuntimeError("kvforge attention called on a layer without a kvforge handle: use kvforge.hf.use_kvforge(model)")
    return h


def attention_function(resolve: Callable[[Any], Any] = _handle_of):
    """A transformers attention function: ``(module, query [B, Hq, Tq, D], key, value
    [B, Hkv, S, D], attention_mask, scaling, dropout, **kw) -> ([B, Tq, Hq, D], None)``, which
    sends one sequence's tensors to ``resolve(module).attend(module.layer_idx, q, k, v,
    scaling)``. By default the handle is the one ``use_kvforge`` put on the layer."""

    def kvforge_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise ValueError("kvforge attention is inference only: put the model in eval() mode (dropout > 0)")
        for name in ("sliding_window", "softcap"):
            if kwargs.get(name) is not None:
                raise ValueError(f"kvforge attention does not implement {name}={kwargs[name]!r}")
        scaling = module.scaling if scaling is None else scaling
        handle = resolve(module)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"kvforge attention takes a [batch, keys] padding mask, got shape {tuple(attention_mask.shape)}")
        if hasattr(handle, "attend_batch"):
            return handle.attend_batch(module.layer_idx, query, key, value, scaling, attention_mask), None
        # A backend of one sequence (``attend`` only): batch 1 without padding.
        if query.shape[0] != 1:
            raise ValueError(f"kvforge attention backend {type(handle).__name__} runs batch 1, got batch {query.shape[0]}")
        if attention_mask is not None:
            raise ValueError(f"kvforge attention backend {type(handle).__name__} does not support padding: attention_mask has masked positions")
        out = handle.attend(module.layer_idx, query[0], key[0], value[0], scaling)
        return out.unsqueeze(0), None

    return kvforge_attention_forward


def no_mask(*args, attention_mask=None, **kwargs):
    """Mask function for kvforge attention: no ``[B, 1, Tq, S]`` mask is built (the cache
    applies causality). A 2D padding mask with a masked position is passed on as a bool
    ``[B, S]`` tensor (cut to the last ``kv_length`` columns), from which each row keeps only
    its real tokens; without one (or with nothing masked) the attention gets None."""
    if attention_mask is None or getattr(attention_mask, "dim", lambda: 0)() != 2 or bool(attention_mask.all()):
        return None
    kv = kwargs.get("kv_length")
    if isinstance(kv, int) and 0 < kv < attention_mask.shape[-1]:
        attention_mask = attention_mask[:, -kv:]
    return attention_mask.bool()


def register(name: str = ATTN_NAME, fn: Optional[Callable] = None) -> str:
    """Registers ``fn`` (default :func:`attention_function`) and :func:`no_mask` with
    transformers under ``name``; returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fn if fn is not None else attention_function())
    AttentionMaskInterface.register(name, no_mask)
    return name


def use_kvforge(model, spec: str = "specs/rdkv.toml", tier: Optional[str] = "b4", root: Optional[str] = None,
                max_tokens: Optional[int] = None, control: Optional[Control] = None, certify: Any = None,
                exact_prefill: bool = False, codebooks: Any = None, prefill: Optional[str] = None,
                cuda_graph: bool = False, sink_pages: int = 0, recent_pages: int = 0) -> KvforgeAttention:
    """Runs every attention layer of ``model`` on kvforge: registers the ``"kvforge"``
    attention, gives each layer (every submodule with a ``layer_idx``) the returned handle and
    sets ``model.config._attn_implementation``. ``spec``/``tier``/``root`` as for
    :class:`kvforge.Cache` (relative specs are found under ``root``, ``$KVFORGE_ROOT`` or the
    working directory); ``max_tokens``: cache capacity per layer and kv head (default the
    model's ``max_position_embeddings`` + 256, at least 1024). ``control``: a :class:`Control`
    applied after every prompt; ``certify``: a ``kvforge.Certifier`` for decode steps;
    ``prefill``: how a new prompt's queries are answered (:class:`KvforgeAttention`): default
    ``"sdpa"`` (exact, torch SDPA on the fresh K/V, as a serving prefill), ``"exact"`` with
    ``control`` or ``exact_prefill`` (fp32 with column sums), ``"cache"`` to attend the
    compressed cache (the prompt's own loss then measures the tier); the prompt is stored
    compressed for the tokens that follow in every mode; ``codebooks``: per-(layer,
    kv head, group) spherical codebooks (a ``kvforge codebook train --per-head`` file or a
    :class:`kvforge.Codebooks`); ``cuda_graph``: :func:`generate`'s default (decode steps
    captured and replayed as one CUDA graph; ``model.generate`` itself never uses one);
    ``sink_pages``, ``recent_pages``: the window policy (:class:`KvforgeAttention`; default
    0, 0, every page coded; ``1, 2`` keeps 64 sink tokens and a 128-191-token window fp16 at
    64-token pages, what rotated 2-3-bit tiers need). Undo with ``handle.detach()``, which
    restores the previous attention implementation."""
    if max_tokens is None:
        max_tokens = max(1024, int(getattr(model.config, "max_position_embeddings", 8192) or 8192) + 256)
    if prefill is None:
        prefill = "exact" if (exact_prefill or control is not None) else "sdpa"
    handle = KvforgeAttention(spec, tier, root=root, max_tokens=max_tokens, control=control, certify=certify,
                              exact_prefill=exact_prefill, codebooks=codebooks, prefill=prefill,
                              sink_pages=sink_pages, recent_pages=recent_pages)
    handle.cuda_graph = bool(cuda_graph)
    return attach(model, handle)


def attach(model, handle):
    """Points every attention layer of ``model`` (each submodule with an int ``layer_idx``) at
    ``handle`` through the registered ``"kvforge"`` attention, and gives the handle
    ``detach()``, which restores the previous attention implementation and calls
    ``handle.reset()``. Returns ``handle``."""
    register()
    for m in model.modules():
        if isinstance(getattr(m, "layer_idx", None), int):
            object.__setattr__(m, _HANDLE_ATTR, handle)
    previous = model.config._attn_implementation

    def detach():
        model.config._attn_implementation = previous
        for m in model.modules():
            if getattr(m, _HANDLE_ATTR, None) is handle:
                object.__delattr__(m, _HANDLE_ATTR)
        handle.reset()

    handle.detach = detach
    model.config._attn_implementation = ATTN_NAME
    return handle


class PassKV:
    """A stand-in for transformers' KV cache that keeps nothing: ``update`` hands a layer its
    step's own key/value back. :func:`generate` passes it as ``past_key_values``, so that a
    decode step's attention sees the new token only (kvforge's caches hold the context), no
    fp16 copy of the context grows, and transformers builds no mask (the mask sizes are the
    step's own)."""

    is_compileable = False

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0):
        n = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return n, 0


def handle_of(model) -> KvforgeAttention:
    """The :class:`KvforgeAttention` ``use_kvforge`` put on ``model``'s layers."""
    for m in model.modules():
        h = getattr(m, _HANDLE_ATTR, None)
        if h is not None:
            return h
    raise RuntimeError("model does not run on kvforge attention: call kvforge.hf.use_kvforge(model)")


def prompt_positions(mask):
    """Position ids of a left-padded batch as transformers' ``generate`` makes them: the real
    tokens count from 0, padding gets 1. ``mask`` [B, S] (1: a real token) -> [B, S] long."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def generate(model, input_ids, attention_mask=None, max_new_tokens: int = 32, cuda_graph: Optional[bool] = None,
             handle: Optional[KvforgeAttention] = None):
    """Greedy decoding of ``input_ids`` [B, S] (left padded, ``attention_mask`` [B, S] or None)
    on kvforge attention: returns the ``max_new_tokens`` new tokens [B, N] (no early stop at
    an end-of-sequence token). ``model`` must run on kvforge (:func:`use_kvforge`).

    The prompt is one forward (``prefill`` as ``use_kvforge`` set it, the K/V written into the
    caches), then one forward per token whose attention layers get the step's own key/value
    only (:class:`PassKV`: transformers keeps no KV copy): each layer appends and attends in
    one call (``Cache.step``). With ``cuda_graph=True`` (default: what ``use_kvforge`` was
    given) a decode step — embedding, every layer, the logits and the next token's argmax —
    is captured once with ``torch.cuda.CUDAGraph`` and replayed: each step then costs the host
    one ``graph_prepare`` and one ``graph_commit`` per layer (page bookkeeping, no tensor
    work) and one replay. The graph is captured again when a layer's launches change (a page
    filled and its table outgrew its buffers, another split count): a few times per
    generation; the next ``generate`` of the same batch size replays the same graph while the
    keys hold (same prompt length class, reused caches). A step that fills a layer's tail page runs without the graph (the page is
    encoded before that step's decode reads it, as without a graph), once per page of tokens. Where a step cannot run in a graph (``graph_prepare`` raises: out of pages,
    a tier that encodes on the host, controllers and certifiers) the generation warns once and
    goes on without it. Kernel faults of replayed steps are raised by ``Cache.synchronize()``.
    """
    import torch

    h = handle if handle is not None else handle_of(model)
    if cuda_graph is None:
        cuda_graph = h.cuda_graph
    if cuda_graph and (h.control is not None or h.certify is not None):
        warnings.warn("kvforge.hf.generate: control= and certify= run without a CUDA graph", UserWarning, stacklevel=2)
        cuda_graph = False
    rows, width = input_ids.shape
    dev = input_ids.device
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None
    pos = prompt_positions(attention_mask) if attention_mask is not None else torch.arange(width, device=dev).expand(rows, width)
    out = torch.empty(rows, max_new_tokens, dtype=torch.long, device=dev)
    if max_new_tokens <= 0:
        return out
    pkv = PassKV()
    h._step_mode = False
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, past_key_values=pkv, use_cache=True,
                       logits_to_keep=1).logits
        ids = logits[:, -1].argmax(-1, keepdim=True)
        out[:, :1].copy_(ids)
        nxt = pos[:, -1:] + 1
        layers = [h.layers[i] for i in sorted(h.layers)]
        cur = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        h._step_mode = True
        try:
            h._stream = cur.cuda_stream if cur is not None else None
            graph = None
            if cuda_graph:
                # The last generate()'s graph of this batch size replays again while every
                # layer's graph_prepare key is the one it was captured with.
                graph = h._graphs.get(rows)
                if graph is not None and graph.model is model:
                    graph.ids.copy_(ids)
                    graph.pos.copy_(nxt)
                else:
                    graph = _StepGraph(model, pkv, ids, nxt, rows, dev)
                h._graphs[rows] = graph
            for i in range(1, max_new_tokens):
                if graph is not None and not graph.warm:
                    # The first decode step runs plainly on the capture stream (torch's advice:
                    # lazily made per-stream state, e.g. cuBLAS workspaces, exists before a capture).
                    graph.warm_step(h, cur)
                    out[:, i:i + 1].copy_(graph.ids)
                    continue
                if graph is not None:
                    if _replay_step(h, graph, layers, "generate", i):
                        out[:, i:i + 1].copy_(graph.ids)
                        continue
                    ids, nxt = graph.ids.clone(), graph.pos.clone()
                    h._graphs.pop(rows, None)
                    graph = None
                logits = model(input_ids=ids, position_ids=nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1).logits
                ids = logits[:, -1].argmax(-1, keepdim=True)
                out[:, i:i + 1].copy_(ids)
                nxt = nxt + 1
        finally:
            h._step_mode, h._stream, h._capture = False, None, None
    return out


def score(model, input_ids, prefix: int = 64, cuda_graph: Optional[bool] = None, handle: Optional[KvforgeAttention] = None):
    """Teacher-forced negative log-likelihoods of ``input_ids`` [B, S] (no padding) decoded on
    kvforge attention, as a model would see the text token by token: tokens ``[0, prefix)`` are
    one prompt forward (attended as ``use_kvforge``'s ``prefill`` says), then every later token
    is one decode step (``Cache.step``: appended, encoded as the cache's policy says, and
    attended over the cache), whose logits score the token after it. Returns the NLLs of tokens
    ``prefix .. S - 1``, [B, S - prefix] float32 (``exp(mean)`` is their perplexity).

    What it measures that a one-forward perplexity over a cache cannot: each token's query
    attends the cache as it stood at that token, so a window policy (``sink_pages``,
    ``recent_pages``) and the pages' encoding as they leave the window take effect as in
    decoding. Steps replay a CUDA graph as in :func:`generate` (``cuda_graph``)."""
    import torch

    h = handle if handle is not None else handle_of(model)
    if cuda_graph is None:
        cuda_graph = h.cuda_graph
    if cuda_graph and (h.control is not None or h.certify is not None):
        cuda_graph = False
    rows, width = input_ids.shape
    if not 1 <= prefix < width:
        raise ValueError(f"kvforge.hf.score: prefix {prefix} must lie in [1, {width}) for {width} tokens")
    dev = input_ids.device
    nll = torch.empty(rows, width - prefix, dtype=torch.float32, device=dev)

    def nll_of(logits, target):
        return -torch.log_softmax(logits[:, -1].float(), -1).gather(-1, target)

    pkv = PassKV()
    h._step_mode = False
    with torch.inference_mode():
        pos = torch.arange(prefix, device=dev).expand(rows, prefix)
        logits = model(input_ids=input_ids[:, :prefix], position_ids=pos, past_key_values=pkv, use_cache=True, logits_to_keep=1).logits
        nll[:, :1].copy_(nll_of(logits, input_ids[:, prefix:prefix + 1]))
        layers = [h.layers[i] for i in sorted(h.layers)]
        cur = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        h._step_mode = True
        try:
            h._stream = cur.cuda_stream if cur is not None else None
            graph = _ScoreGraph(model, pkv, rows, dev, nll_of) if cuda_graph else None
            for t in range(prefix, width - 1):
                step_in = (input_ids[:, t:t + 1], input_ids[:, t + 1:t + 2], t)
                if graph is not None:
                    graph.load(*step_in)
                    if not graph.warm:
                        graph.warm_step(h, cur)
                    elif not _replay_step(h, graph, layers, "score", t):
                        graph = None
                    if graph is not None:
                        nll[:, t + 1 - prefix:t + 2 - prefix].copy_(graph.out)
                        continue
                ids, target, _ = step_in
                p = torch.full((rows, 1), t, dtype=torch.long, device=dev)
                logits = model(input_ids=ids, position_ids=p, past_key_values=pkv, use_cache=True, logits_to_keep=1).logits
                nll[:, t + 1 - prefix:t + 2 - prefix].copy_(nll_of(logits, target))
        finally:
            h._step_mode, h._stream, h._capture = False, None, None
    return nll


def _replay_step(h: KvforgeAttention, graph, layers, what: str, at: int) -> bool:
    """One decode step through ``graph``: every layer's ``graph_prepare``, then a plain step
    where a layer fills its tail page (the page is encoded before the step's decode reads it),
    else the replay and every layer's ``graph_commit``. False where the step cannot run in a
    graph (``graph_prepare`` raised: warned, ``what`` names the caller, ``at`` the token); the
    caller goes on without the graph."""
    try:
        keys = [st["cache"].graph_prepare(st["seqs"], stream=h._stream) for st in layers]
    except Exception as e:  # noqa: BLE001 - any reason the step cannot run in a graph
        warnings.warn(f"kvforge.hf.{what}: decoding without a CUDA graph from token {at}: {e}", UserWarning, stacklevel=3)
        return False
    if any(key is None for key in keys):
        graph.plain_step()
    else:
        graph.run(h, keys)
        for st in layers:
            st["cache"].graph_commit(st["seqs"], stream=h._stream)
            st["n"] += 1
    return True


class _StepGraph:
    """One decode step of the whole model captured as a CUDA graph: static token and position
    inputs, which the graph itself advances (the argmax written into ``ids``, ``pos`` + 1)."""

    def __init__(self, model, pkv, ids, pos, rows: int, dev):
        import torch

        self.model, self.pkv = model, pkv
        self.ids, self.pos = ids.clone(), pos.clone()
        self.graph = None
        self.keys: Optional[List[int]] = None
        self.stream = torch.cuda.Stream(dev)
        self.pool = None
        self.captures = 0
        self.warm = False

    def warm_step(self, h: KvforgeAttention, cur) -> None:
        """One decode step without the graph, on the capture stream (``ids``, ``pos`` advanced)."""
        import torch

        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            h._stream = self.stream.cuda_stream
            try:
                self._step()
            finally:
                h._stream = cur.cuda_stream
        cur.wait_stream(self.stream)
        self.warm = True

    def plain_step(self) -> None:
        """One decode step without the graph on the current stream (``ids``, ``pos`` advanced)."""
        self._step()

    def _step(self):
        logits = self.model(input_ids=self.ids, position_ids=self.pos, past_key_values=self.pkv, use_cache=True, logits_to_keep=1).logits
        self.ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.pos.add_(1)

    def run(self, h: KvforgeAttention, keys: List[int]) -> None:
        """Replays the step, capturing it first where ``keys`` (every layer's
        ``graph_prepare``) differ from the captured ones."""
        import torch

        if self.graph is None or keys != self.keys:
            g = torch.cuda.CUDAGraph()
            cur = torch.cuda.current_stream()
            self.stream.wait_stream(cur)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.graph = None  # the old graph's memory goes back to the pool first
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                h._capture = self.stream.cuda_stream
                try:
                    self._step()
                finally:
                    h._capture = None
            cur.wait_stream(self.stream)
            self.graph, self.keys = g, keys
            self.captures += 1
        self.graph.replay()


class _ScoreGraph(_StepGraph):
    """A :class:`_StepGraph` whose step scores the next token instead of choosing it: static
    inputs (token, position, target) that the host loads before each step, and the target's
    negative log-likelihood in ``out``."""

    def __init__(self, model, pkv, rows: int, dev, nll_of):
        import torch

        zeros = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        super().__init__(model, pkv, zeros, zeros, rows, dev)
        self.target = zeros.clone()
        self.out = torch.zeros(rows, 1, dtype=torch.float32, device=dev)
        self.nll_of = nll_of

    def load(self, ids, target, t: int) -> None:
        self.ids.copy_(ids)
        self.target.copy_(target)
        self.pos.fill_(t)

    def _step(self):
        logits = self.model(input_ids=self.ids, position_ids=self.pos, past_key_values=self.pkv, use_cache=True, logits_to_keep=1).logits
        self.out.copy_(self.nll_of(logits, self.target))


def bytes_per_token(model) -> float:
    """Resident bytes per token per kv head of ``model``'s kvforge caches (mean over layers)."""
    for m in model.modules():
        h = getattr(m, _HANDLE_ATTR, None)
        if h is not None:
            return h.bytes_per_token()
    raise RuntimeError("model does not run on kvforge attention: call kvforge.hf.use_kvforge(model)")
