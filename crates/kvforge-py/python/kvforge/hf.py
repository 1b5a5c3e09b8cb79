"""transformers integration: run a model's attention on kvforge's compressed KV cache.

::

    import torch, kvforge.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16).cuda().eval()
    kv = kvforge.hf.use_kvforge(model, spec="specs/rdkv.toml", tier="b4")
    loss = model(input_ids=ids, labels=ids).loss          # prompt: attend_prefix on the int4 cache
    out = model.generate(input_ids=ids, max_new_tokens=32)  # new tokens: decode
    kv.bytes_per_token()                                    # resident bytes / token / kv head

``use_kvforge`` registers an attention function (and a mask function that builds no mask:
kvforge applies the causal structure itself) with transformers' ``AttentionInterface`` under
the name ``"kvforge"`` and points ``model.config._attn_implementation`` at it. Every attention
layer then keeps one :class:`kvforge.Cache` (its kv heads, its GQA group): the layer's new
post-RoPE K/V are appended (only tokens the cache has not seen: transformers' own cache passes
all of them each step), full pages are encoded into ``tier``, and the queries are answered by
``attend_prefix`` (several query tokens, causal) or ``decode`` (one token) on what is stored.
A forward whose queries cover every key (a new prompt, ``use_cache=False`` or a fresh
``generate``) starts a new sequence: the layer's cache is rebuilt, so per-cache state such as
spherical radius scales never leaks from one text into the next.

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

Limits: batch 1 without padding, inference only (no dropout, no gradients through the
cache), no sliding window or logit soft-capping; tensors on CUDA in the spec's dtype (load
the model with ``dtype=torch.float16`` for the shipped specs). transformers still keeps its
own fp16 KV cache during ``generate``; kvforge's cache holds the compressed copy the
attention reads.

``import kvforge.hf`` needs neither torch nor transformers; they are imported when used.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any, Callable, Dict, List, Optional

__all__ = [
    "ATTN_NAME",
    "Control",
    "KvforgeAttention",
    "attention_function",
    "bytes_per_token",
    "no_mask",
    "register",
    "use_kvforge",
]

ATTN_NAME = "kvforge"
_HANDLE_ATTR = "_kvforge_attention"


class Control:
    """A tier controller for every layer: ``kvforge.Controller(cache, policy, budget=..., **kw)``
    is made per layer cache and applied once after each prompt. ``budget`` is bytes per token
    per kv head (``per="token"``) unless ``kw`` says otherwise; see :class:`kvforge.Controller`."""

    def __init__(self, policy: str = "rdr", budget: float = 64.0, **kw: Any):
        self.policy, self.budget, self.kw = policy, float(budget), dict(kw)

    def make(self, kvforge, cache):
        return kvforge.Controller(cache, policy=self.policy, budget=self.budget, **self.kw)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.kw.items())
        return f"Control({self.policy!r}, budget={self.budget}{extra})"


def exact_attention(q, k, v, scaling: float, chunk: int = 1024, column_sums: bool = True):
    """Exact causal attention in fp32 with the queries at the last ``Tq`` of ``S`` positions,
    and the attention column sums: q [Hq, Tq, D], k/v [Hkv, S, D] -> (out [Tq, Hq, D] in q's
    dtype, mass [Hkv, S] float64 = Σ over queries and the kv head's GQA group of a_τt, or None
    with ``column_sums=False``). Queries are processed ``chunk`` at a time (memory
    Hq × chunk × S × 4 bytes)."""
    import torch

    hq, tq, d = q.shape
    hkv, s, _ = k.shape
    g = hq // hkv
    kf, vf = k.float(), v.float()
    qg = q.float().reshape(hkv, g, tq, d)
    out = torch.empty(tq, hq, d, dtype=q.dtype, device=q.device)
    mass = torch.zeros(hkv, s, dtype=torch.float64, device=q.device) if column_sums else None
    cols = torch.arange(s, device=q.device)
    for i0 in range(0, tq, chunk):
        i1 = min(tq, i0 + chunk)
        sc = torch.einsum("hgtd,hsd->hgts", qg[:, :, i0:i1], kf) * scaling
        pos = torch.arange(i0, i1, device=q.device) + (s - tq)
        sc = sc.masked_fill(cols[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(sc, dim=-1)
        out[i0:i1] = torch.einsum("hgts,hsd->thgd", p, vf).reshape(i1 - i0, hq, d).to(q.dtype)
        if mass is not None:
            mass += p.sum(dim=(1, 2)).double()
    return out, mass


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


class KvforgeAttention:
    """Per-model state: one ``kvforge.Cache`` (one sequence) per attention layer.

    ``attend(layer, q, k, v, scaling)`` takes one sequence's tensors as transformers' attention
    layers hold them: ``q [Hq, Tq, D]`` (the last ``Tq`` positions), ``k, v [Hkv, S, D]``
    (post-RoPE, every token so far), and returns ``[Tq, Hq, D]``.
    """

    def __init__(self, spec: str = "specs/rdkv.toml", tier: Optional[str] = "b4", root: Optional[str] = None,
                 max_tokens: int = 8192 + 256, module: Any = None, control: Optional[Control] = None,
                 certify: Any = None, exact_prefill: bool = False, codebooks: Any = None):
        # The extension is looked up when a handle is made, not when this file is imported:
        # ``import kvforge.hf`` works without a GPU, torch or transformers.
        self.kvforge = module if module is not None else importlib.import_module("kvforge")
        self.spec, self.tier = spec, tier
        self.root = None if root is None else str(root)
        self.max_tokens = int(max_tokens)
        self.layers: Dict[int, Dict[str, Any]] = {}  # layer -> {"cache", "seq", "n"}
        self.last_bytes: Dict[int, float] = {}
        # A controller decides from an exact prefill's attention; so can a caller who asks.
        self.control, self.certify = control, certify
        self.exact_prefill = bool(exact_prefill or control is not None)
        self.reports: Dict[int, Any] = {}       # layer -> last kvforge.ControlReport
        self.certificates: Dict[int, Any] = {}  # layer -> [kvforge.HeadCertificate] of the last step
        # Per-(layer, kv head, group) spherical codebooks, a path or a kvforge.Codebooks.
        if codebooks is not None and not hasattr(codebooks, "layer"):
            codebooks = self.kvforge.Codebooks(str(codebooks))
        self.codebooks = codebooks
        self._warned_placeholder = False

    def reset(self) -> None:
        """Forget every sequence (dropping the caches frees their GPU memory)."""
        self.layers = {}
        self.reports, self.certificates = {}, {}

    def _new_cache(self, layer: int, q, k) -> Dict[str, Any]:
        hq, _, d = q.shape
        hkv, s, _ = k.shape
        kw = dict(head_dim=d, num_kv_heads=hkv, gqa=hq // hkv, max_tokens=max(self.max_tokens, s), target=self.tier,
                  root=self.root)
        index = getattr(getattr(q, "device", None), "index", None)
        if index:  # device 0 is the Cache's default
            kw["device"] = index
        cache = self.kvforge.Cache(self.spec, **kw)
        mixed = list(getattr(cache, "mixed_key_tiers", ()))
        if mixed:  # TriZone: order each head's channels by the prompt's weights before coding
            order = channel_order(q, k)
            for t in mixed:
                cache.set_channel_order(t, order)
        self._set_codebooks(layer, cache)
        if self.certify is not None:
            cache.keep_originals()
        st = {"cache": cache, "seq": cache.add_sequence(), "n": 0}
        self.layers[layer] = st
        return st

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

    def attend(self, layer: int, q, k, v, scaling: float):
        check_shapes(q, k, v)
        hq, tq, d = q.shape
        hkv, s, _ = k.shape
        st = self.layers.get(layer)
        # a new sequence: transformers passed fewer tokens than we hold, or queries for all of them
        prompt = st is None or st["n"] > s or (tq == s and st["n"] > 0)
        if prompt:
            st = self._new_cache(layer, q, k)
        cache, seq = st["cache"], st["seq"]
        if s > st["n"]:  # append only the tokens not seen yet, [T, Hkv, D]
            kn = k[:, st["n"]:].transpose(0, 1).contiguous()
            vn = v[:, st["n"]:].transpose(0, 1).contiguous()
            cache.append(seq, kn, vn)
            st["n"] = s
        if prompt and tq == s and self.exact_prefill:
            out, mass = exact_attention(q, k, v, scaling, column_sums=self.control is not None)
            if self.control is not None:
                self.reports[layer] = self.control.make(self.kvforge, cache).apply(cache, seq, token_mass=mass)
            self.last_bytes[layer] = context_bytes(cache, seq)
            return out
        qq = q.transpose(0, 1)  # [Tq, Hq, D]
        if abs(scaling * math.sqrt(d) - 1.0) > 1e-6:  # kvforge scales scores by 1/sqrt(d)
            qq = qq * (scaling * math.sqrt(d))
        qq = qq.contiguous()
        if tq == 1 and self.certify is not None:
            out, _, self.certificates[layer] = self.certify.decode(cache, qq, [seq])
        elif tq == 1:
            out, _ = cache.decode(qq, seqs=[seq])
        else:  # query i sits at position s - tq + i and attends tokens 0..s - tq + i
            lengths = list(range(s - tq + 1, s + 1))
            out, _ = cache.attend_prefix(seq, qq, lengths)
        self.last_bytes[layer] = context_bytes(cache, seq)
        return out

    def bytes_per_token(self) -> float:
        """Resident bytes per token of the context per kv head (page headers and the fp16 tail
        page included, dropped positions counted: :func:`context_bytes`), mean over layers, as
        of each layer's last call; NaN before the first forward."""
        vals = list(self.last_bytes.values())
        return sum(vals) / len(vals) if vals else float("nan")

    def memory_report(self) -> Dict[int, Any]:
        """``Cache.memory_report()`` of every layer's cache."""
        return {layer: st["cache"].memory_report() for layer, st in sorted(self.layers.items())}

    def describe(self) -> Dict[str, Any]:
        return {"kind": "kvforge", "spec": self.spec, "tier": self.tier,
                "kvforge_version": getattr(self.kvforge, "__version__", "?")}


def context_bytes(cache, seq: int) -> float:
    """Resident bytes of ``cache`` per logical token of ``seq`` per kv head (page headers, the
    fp16 tail page and padding included; dropped positions count as tokens, so eviction
    lowers it). For a cache without drops this equals ``cache.bytes_per_token()``."""
    n = cache.seq_len(seq) * cache.num_kv_heads
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
        if query.shape[0] != 1:
            raise ValueError(f"kvforge attention runs batch 1 (no padding masks), got batch {query.shape[0]}")
        if dropout:
            raise ValueError("kvforge attention is inference only: put the model in eval() mode (dropout > 0)")
        for name in ("sliding_window", "softcap"):
            if kwargs.get(name) is not None:
                raise ValueError(f"kvforge attention does not implement {name}={kwargs[name]!r}")
        scaling = module.scaling if scaling is None else scaling
        out = resolve(module).attend(module.layer_idx, query[0], key[0], value[0], scaling)
        return out.unsqueeze(0), None

    return kvforge_attention_forward


def no_mask(*args, attention_mask=None, **kwargs):
    """Mask function for kvforge attention: none is built (the cache applies causality).
    A padding mask with a masked position is refused: batch 1 without padding only."""
    if attention_mask is not None and getattr(attention_mask, "dim", lambda: 0)() == 2 and not bool(attention_mask.all()):
        raise ValueError("kvforge attention does not support padding: attention_mask has masked positions")
    return None


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
                exact_prefill: bool = False, codebooks: Any = None) -> KvforgeAttention:
    """Runs every attention layer of ``model`` on kvforge: registers the ``"kvforge"``
    attention, gives each layer (every submodule with a ``layer_idx``) the returned handle and
    sets ``model.config._attn_implementation``. ``spec``/``tier``/``root`` as for
    :class:`kvforge.Cache` (relative specs are found under ``root``, ``$KVFORGE_ROOT`` or the
    working directory); ``max_tokens``: cache capacity per layer and kv head (default the
    model's ``max_position_embeddings`` + 256, at least 1024). ``control``: a :class:`Control`
    applied after every prompt; ``certify``: a ``kvforge.Certifier`` for decode steps;
    ``exact_prefill``: attend prompts exactly (fp32, on the model's K/V) and store them
    compressed for the tokens that follow (implied by ``control``); ``codebooks``: per-(layer,
    kv head, group) spherical codebooks (a ``kvforge codebook train --per-head`` file or a
    :class:`kvforge.Codebooks`). Undo with ``handle.detach()``, which restores the previous
    attention implementation."""
    if max_tokens is None:
        max_tokens = max(1024, int(getattr(model.config, "max_position_embeddings", 8192) or 8192) + 256)
    handle = KvforgeAttention(spec, tier, root=root, max_tokens=max_tokens, control=control, certify=certify,
                              exact_prefill=exact_prefill, codebooks=codebooks)
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


def bytes_per_token(model) -> float:
    """Resident bytes per token per kv head of ``model``'s kvforge caches (mean over layers)."""
    for m in model.modules():
        h = getattr(m, _HANDLE_ATTR, None)
        if h is not None:
            return h.bytes_per_token()
    raise RuntimeError("model does not run on kvforge attention: call kvforge.hf.use_kvforge(model)")
