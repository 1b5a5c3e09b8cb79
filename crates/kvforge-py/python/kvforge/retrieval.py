"""ParisKV retrieval decode (seed 001) for a transformers model: decode steps attend the sinks,
the local window and the top-``k`` keys of the rest, retrieved on the GPU from compact
summaries, with the rest's fp16 K/V kept in pinned host memory.

::

    import torch, kvforge.retrieval
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float16).cuda().eval()
    r = kvforge.retrieval.use_retrieval(model, k=256, sinks=64, local=256)
    out = model.generate(**tok(prompt, return_tensors="pt").to("cuda"), max_new_tokens=16)
    r.stats()   # retrieval-region keys, GPU-resident summary bytes per key, steps retrieved

Every attention layer keeps one :class:`kvforge.ParisIndex`. A prompt is attended exactly (torch
SDPA, as a serving prefill); its positions are split into sinks ``[0, sinks)``, the retrieval
region and the last ``local`` positions (seed 001 §4.2.1). The region's K/V go to pinned host
memory and their summaries are encoded on the GPU. Each decode token joins the local window;
once ``update`` tokens wait past it, the oldest ``update`` local tokens move into the region
(summaries encoded, K/V offloaded). A decode query retrieves the region's top-``k`` keys (collision vote, top-C, 4-bit rerank,
top-k) per query head, or with ``per_query_head=False`` once per kv head (the kernels' faster
mode: one vote, top-k and fetch for the GQA group), and attends over sinks + local + retrieved
rows with one softmax; while the region holds fewer than ``dense_below`` keys (default
``ParisIndex.dense_below``, 2048) the step attends every key exactly instead.

Per kv head, ``rank`` orders the group's candidates (the vote is the summed query's either way):
``"sum"`` (default) by the summed query's, ``"max"`` by the largest of the heads' own rerank
estimates (its kernel has not yet run its GPU test, hence not the default). Per query head is the default here because it is the mode whose quality was measured on
the kernels (needle 6/6, H100); in the SmolLM2 simulation per kv head found the needle 2/3 with
``"sum"`` and 3/3 with ``"max"`` (``sim:paris-k256-hmax``, docs/paris.md).

``tier`` (with ``spec``) keeps the sinks and the local window in a kvforge cache instead, coded
in that tier (``use_retrieval(model, spec="specs/rotated.toml", tier="r3")``): every layer then
holds one :class:`kvforge.RetrievalCache`, whose pages past the window move into its index as the
window fills, and whose decode attends both with one softmax on the GPU. Sinks, local window and
update buffer are then whole pages (multiples of the spec's page size, 64 tokens).

Limits: batch 1 without padding; inference only; the index takes host byte strings, so every
layer's step synchronises the GPU once (this path measures quality and retrieval, not speed:
``kvforge_rt::paris`` and ``benches/paris`` time the kernels). transformers keeps its own fp16
cache during ``generate``; the dense rows are read from it.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Dict, Optional

from .hf import attach, sdpa_causal

__all__ = ["ParisAttention", "use_retrieval"]

def _bytes(x) -> bytes:
    """fp16 bytes of a tensor, row-major."""
    import torch

    return x.detach().to("cpu", torch.float16).contiguous().numpy().tobytes()


def _rows(x, lo: int, hi: int):
    """``x [Hkv, S, D]`` positions ``[lo, hi)`` as ``[rows][Hkv][D]``."""
    return x[:, lo:hi].transpose(0, 1)


def _check_step(st, s: int, tq: int) -> None:
    """A decode step adds one position to a layer that held ``st["n"]``."""
    if tq != 1 or s != st["n"] + 1:
        raise ValueError(f"kvforge.retrieval: a decode step adds one token (had {st['n']} positions, got {s} with {tq} queries)")


def _attend_all(q, k, v, scaling: float):
    """One decode query per row on every key (no mask): ``q [B, Hq, 1, D]``, ``k, v
    [B, Hkv, S, D]`` -> ``[B, 1, Hq, D]``."""
    import torch

    g = q.shape[1] // k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale=scaling)
    return o.transpose(1, 2)


class ParisAttention:
    """Per-model state of retrieval decode: one :class:`kvforge.ParisIndex` per layer (module
    docs). ``attend_batch(layer, q [1, Hq, Tq, D], k, v [1, Hkv, S, D], scaling, mask)`` ->
    ``[1, Tq, Hq, D]``."""

    def __init__(self, k: int = 256, sinks: int = 64, local: int = 256, update: int = 64,
                 capacity: int = 8192 + 256, host_budget_gb: float = 8.0, module: Any = None, per_query_head: bool = True,
                 rank: str = "max", layout: Optional[str] = None, spec: Optional[str] = None, tier: Optional[str] = None,
                 root: Optional[str] = None, dense_below: Optional[int] = None):
        if k < 1 or sinks < 0 or local < 1 or not 1 <= update <= local:
            raise ValueError(f"kvforge.retrieval: need k >= 1, sinks >= 0, local >= 1 and 1 <= update <= local; got k={k}, sinks={sinks}, local={local}, update={update}")
        if rank not in ("max", "sum"):
            raise ValueError(f"kvforge.retrieval: rank must be 'max' or 'sum', got {rank!r}")
        if layout not in (None, "whole64", "subspace4"):
            raise ValueError(f"kvforge.retrieval: layout must be 'whole64', 'subspace4' or None, got {layout!r}")
        if (spec is None) != (tier is None):
            raise ValueError(f"kvforge.retrieval: pass spec and tier together (the GPU region's format), got spec={spec!r}, tier={tier!r}")
        if dense_below is not None and dense_below < 0:
            raise ValueError(f"kvforge.retrieval: dense_below must be >= 0, got {dense_below}")
        self.spec, self.tier, self.root, self.dense_below = spec, tier, root, dense_below
        self.kvforge = module if module is not None else importlib.import_module("kvforge")
        # The ``tier`` path's regions are whole pages of the spec's page size.
        self.page = int(self.kvforge.spec_page_tokens(spec, root=root)) if tier is not None else 0
        if tier is not None and (sinks % self.page or local % self.page or update % self.page):
            raise ValueError(f"kvforge.retrieval: with a tier, sinks, local and update are whole pages of {self.page} tokens (spec {spec}); got {sinks}, {local}, {update}")
        self.k, self.sinks, self.local, self.update = int(k), int(sinks), int(local), int(update)
        self.capacity, self.host_budget_gb = int(capacity), float(host_budget_gb)
        self.per_query_head, self.rank, self.layout = bool(per_query_head), rank, layout
        # layer -> {"ix", "n" (positions seen), "sinks", "r_end" (end of the retrieval region)}
        self.layers: Dict[int, Dict[str, Any]] = {}
        self.retrieved_steps = 0
        self.dense_steps = 0

    def reset(self) -> None:
        """Forget every sequence (dropping the indexes frees their GPU and pinned memory)."""
        self.layers = {}

    def _new_index(self, layer: int, hkv: int, gqa: int, d: int) -> Dict[str, Any]:
        """A fresh index for a new prompt (the previous prompt's regions are stale)."""
        ix = self.kvforge.ParisIndex(d, hkv, gqa, self.capacity, dense_capacity=self.sinks + self.local + self.update,
                                     max_k=max(self.k, 8), max_candidates=max(65536, 8 * self.k), host_budget_gb=self.host_budget_gb,
                                     per_query_head=self.per_query_head, rank=self.rank, layout=self.layout)
        st = self.layers[layer] = {"ix": ix}
        return st

    def _set_dense(self, st, k, v) -> None:
        """Sinks and everything after the retrieval region, from the model's own K/V."""
        import torch

        n, s0, r = st["n"], st["sinks"], st["r_end"]
        dk = torch.cat([_rows(k, 0, s0), _rows(k, r, n)])
        dv = torch.cat([_rows(v, 0, s0), _rows(v, r, n)])
        st["ix"].set_dense(0, _bytes(dk), _bytes(dv))

    def _attend_cache(self, layer: int, q, k, v, scaling: float):
        """The ``tier`` path: the layer's :class:`kvforge.RetrievalCache` (module docs)."""
        _, hq, tq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        k0, v0 = k[0], v[0]
        st = self.layers.get(layer)
        if st is None or st["n"] >= s or tq == s:
            # A prompt: exact attention; the cache takes every position and moves its pages
            # past sinks + window to the index.
            rc = self.kvforge.RetrievalCache(self.spec, d, hkv, hq // hkv, self.capacity, target=self.tier,
                                             sink_pages=self.sinks // self.page, local_pages=self.local // self.page, update_pages=self.update // self.page,
                                             max_k=max(self.k, 8), max_candidates=max(65536, 8 * self.k), host_budget_gb=self.host_budget_gb,
                                             per_query_head=self.per_query_head, rank=self.rank, layout=self.layout, root=self.root)
            rc.append(0, _bytes(_rows(k0, 0, s)), _bytes(_rows(v0, 0, s)))
            self.layers[layer] = {"rc": rc, "n": s}
            return sdpa_causal(q, k, v, scaling)
        _check_step(st, s, tq)
        st["n"] = s
        rc = st["rc"]
        rc.append(0, _bytes(_rows(k0, s - 1, s)), _bytes(_rows(v0, s - 1, s)))
        return self._step(rc, rc.retrieval_len(0), q, k, v, scaling)

    def _step(self, handle, region: int, q, k, v, scaling: float):
        """A decode step once the regions are up to date: every key exactly while the retrieval
        region holds fewer than ``dense_below`` keys, else ``handle.decode`` (a ParisIndex or a
        RetrievalCache; both scale scores by 1/sqrt(d))."""
        import torch

        _, hq, _, d = q.shape
        if region < (handle.dense_below if self.dense_below is None else self.dense_below):
            self.dense_steps += 1
            return _attend_all(q, k, v, scaling)
        self.retrieved_steps += 1
        qs = q[0, :, 0] * (scaling * math.sqrt(d))
        out, _ = handle.decode(_bytes(qs), self.k)
        o = torch.frombuffer(bytearray(out), dtype=torch.float32).view(1, 1, hq, d)
        return o.to(device=q.device, dtype=q.dtype)

    def attend_batch(self, layer: int, q, k, v, scaling: float, mask=None):
        if q.shape[0] != 1:
            raise ValueError(f"kvforge.retrieval runs batch 1, got batch {q.shape[0]}")
        if mask is not None and not bool(mask.all()):
            raise ValueError("kvforge.retrieval does not support padding")
        if self.tier is not None:
            return self._attend_cache(layer, q, k, v, scaling)
        _, hq, tq, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        k0, v0 = k[0], v[0]
        st = self.layers.get(layer)
        if st is None or st["n"] >= s or tq == s:
            # A prompt: exact attention; split its positions and index the retrieval region.
            st = self._new_index(layer, hkv, hq // hkv, d)
            st["n"], st["sinks"] = s, min(self.sinks, s)
            st["r_end"] = max(s - self.local, st["sinks"])
            if st["r_end"] > st["sinks"]:
                st["ix"].append(0, _bytes(_rows(k0, st["sinks"], st["r_end"])), _bytes(_rows(v0, st["sinks"], st["r_end"])))
            self._set_dense(st, k0, v0)
            return sdpa_causal(q, k, v, scaling)
        _check_step(st, s, tq)
        st["n"] = s
        if s - st["r_end"] >= self.local + self.update:
            # The update buffer is full: the oldest `update` local tokens join the region.
            lo, hi = st["r_end"], st["r_end"] + self.update
            st["ix"].append(0, _bytes(_rows(k0, lo, hi)), _bytes(_rows(v0, lo, hi)))
            st["r_end"] = hi
        self._set_dense(st, k0, v0)
        return self._step(st["ix"], st["ix"].len(0), q, k, v, scaling)

    def stats(self) -> Dict[str, Any]:
        """Retrieval-region keys (layer 0), GPU summary bytes per key and kv head, and how many
        layer steps retrieved vs attended densely."""
        st = self.layers.get(min(self.layers)) if self.layers else None
        ix = (st.get("rc") or st.get("ix")) if st else None
        region = (ix.retrieval_len(0) if "rc" in st else ix.len(0)) if st else 0
        return {
            "region_keys": region,
            "summary_bytes_per_key": ix.device_bytes_per_key if ix is not None else None,
            "gpu_region": {"spec": self.spec, "tier": self.tier, "tiers": ix.gpu_tiers(0, 0) if st and "rc" in st else None} if self.tier else "fp16 rows in the index",
            "retrieved_layer_steps": self.retrieved_steps,
            "dense_layer_steps": self.dense_steps,
            "k": self.k, "sinks": self.sinks, "local": self.local, "update": self.update,
            "retrieval": "per query head" if self.per_query_head else f"per kv head, rank {self.rank}",
        }


def use_retrieval(model, k: int = 256, sinks: int = 64, local: int = 256, update: int = 64,
                  capacity: Optional[int] = None, host_budget_gb: float = 8.0, per_query_head: bool = True,
                  rank: str = "max", layout: Optional[str] = None, spec: Optional[str] = None,
                  tier: Optional[str] = None, root: Optional[str] = None) -> ParisAttention:
    """Runs every attention layer of ``model`` with ParisKV retrieval decode (module docs):
    registers the ``"kvforge"`` attention (as :func:`kvforge.hf.use_kvforge` does) with a
    :class:`ParisAttention` handle on every layer. ``capacity``: retrieval-region keys per
    layer (default the model's ``max_position_embeddings`` + 256). ``per_query_head``: one
    retrieval per query head (default), or ``False`` for one per kv head, whose candidates
    ``rank`` orders: ``"sum"`` (default) or ``"max"`` (the largest head estimate, "hmax").
    ``layout``: the GPU summaries, ``"whole64"`` (``head_dim / 2`` bytes: 64 B per key and kv head
    at head dim 128, 1/8 of fp16 K+V) or ``"subspace4"`` (the seed's 112 B at head dim 128);
    ``None`` (default) takes whole64 where the head dim is a multiple of 64, else subspace4.
    ``spec`` and ``tier``: keep sinks and window in a kvforge cache of that spec, coded in that
    tier (:class:`kvforge.RetrievalCache`; ``root`` finds the spec file as ``kvforge.Cache``
    does); default ``None``: fp16 rows in the index. Undo with ``handle.detach()``."""
    if capacity is None:
        capacity = max(1024, int(getattr(model.config, "max_position_embeddings", 8192) or 8192) + 256)
    handle = ParisAttention(k=k, sinks=sinks, local=local, update=update, capacity=capacity, host_budget_gb=host_budget_gb,
                            per_query_head=per_query_head, rank=rank, layout=layout, spec=spec, tier=tier, root=root)
    return attach(model, handle)
