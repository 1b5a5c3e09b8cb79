"""Attention backends of the serving loop: one interface, three implementations.

The interface follows vLLM's ``AttentionBackend`` / ``AttentionImpl`` split and SGLang's
``AttentionBackend`` (docs/serving.md maps each call):

* ``capacity(budget_bytes, max_seqs)`` → ``(block_tokens, num_blocks)``: how many blocks of
  the backend's format a KV budget of device bytes holds (vLLM: ``get_kv_cache_shape`` and the
  block-size / num-GPU-blocks computation of the worker's memory profiling);
* ``allocate(num_blocks, max_seqs)``: the per-layer caches (vLLM: ``kv_caches`` bound to the
  layers; SGLang: ``token_to_kv_pool``);
* ``new_seq(req)`` / ``free_seq(req)``: a sequence enters / leaves (vLLM: the block table rows;
  kvforge: ``Cache.add_sequence`` / ``remove_sequence``);
* ``begin_step(reqs)`` → metadata for one decode step of the batch (vLLM's
  ``AttentionMetadataBuilder.build``; SGLang's ``init_forward_metadata``): FlashInfer plans here
  once for every layer;
* ``prefill(layer, req, q, k, v)`` → exact causal attention of a prompt on its fresh K/V (torch
  SDPA, as a prefill reads activations), and the K/V written to the cache (vLLM:
  ``forward`` with a prefill batch; SGLang: ``forward_extend``);
* ``decode(layer, md, q, k, v)`` → the new tokens' K/V written (vLLM's
  ``reshape_and_cache``), then one query per sequence attends its cache (vLLM: ``forward``
  with a decode batch; SGLang: ``forward_decode``).

CUDA graphs (``run.py --cuda-graph``, steady and tpot modes: a fixed batch): the engine
captures the whole model's decode step once with ``torch.cuda.CUDAGraph`` and replays it
(``engine.StepGraph``); a backend that can run inside one says so (``graph_capable``) and
splits a step into host work before the replay and launches the graph holds:

* ``graph_prepare(reqs)`` → a key, or None: the step's metadata written into fixed device
  buffers (FlashInfer: ``plan`` of a ``use_cuda_graph=True`` wrapper, the write slots;
  kvforge: ``Cache.graph_prepare`` per layer). The engine captures again when the key differs
  from the one the graph was captured with; None: this step must run without the graph
  (kvforge: it fills a tail page, which is encoded before the step's decode reads it);
* ``graph_decode(layer, q, k, v, stream)``: what ``decode`` does, as launches a capture on
  ``stream`` can record (no host copy, allocation or synchronisation);
* ``graph_commit(reqs)``: the host bookkeeping of a replayed step (kvforge's lengths).

vLLM and SGLang do the same for their decode batches (captured per batch size, metadata
rewritten into the captured buffers before each replay: SGLang's
``init_forward_metadata_replay_cuda_graph``).

Tensors: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` in fp16 (T tokens of one prompt, or one token
per sequence of the batch), the output ``[T, Hq, D]``. Softmax scale 1/sqrt(D).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F


def causal_attention(q, k, v):
    """Exact causal attention of one prompt: q [L, Hq, D], k/v [L, Hkv, D] → [L, Hq, D]
    (torch SDPA; GQA through ``enable_gqa``, else the kv heads repeated). On the GPU only the
    fused kernels may run: the math fallback would materialise L x L scores per head."""
    hq, hkv = q.shape[1], k.shape[1]
    qq, kk, vv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    g = hq // hkv
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        try:
            with sdpa_kernel(fused):
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=g > 1)
        except RuntimeError:  # no fused kernel takes GQA here: repeat the kv heads
            with sdpa_kernel(fused):
                o = F.scaled_dot_product_attention(qq, kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1), is_causal=True)
        return o[0].transpose(0, 1)
    try:
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=g > 1)
    except (RuntimeError, TypeError):
        o = F.scaled_dot_product_attention(qq, kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1), is_causal=True)
    return o[0].transpose(0, 1)


def fill_random_(t, gen, chunk=1 << 26):
    """Fills ``t`` (any float dtype, fp8 too) with N(0, 1) chunkwise."""
    flat = t.view(-1)
    for i in range(0, flat.numel(), chunk):
        j = min(flat.numel(), i + chunk)
        flat[i:j].copy_(torch.randn(j - i, device=t.device, dtype=torch.float16, generator=gen))
    return t


class Backend:
    name = "?"
    contiguous = False  # the pool must hand out runs of consecutive blocks

    def __init__(self, layers: int, hq: int, hkv: int, d: int, device):
        self.layers, self.hq, self.hkv, self.d, self.device = layers, hq, hkv, d, torch.device(device)
        self.g = hq // hkv

    # sizing ---------------------------------------------------------------------------
    def block_tokens(self) -> int:
        raise NotImplementedError

    def block_bytes(self) -> float:
        """Device bytes of one block over every layer and kv head of this rank."""
        raise NotImplementedError

    def fixed_bytes(self, max_seqs: int) -> float:
        """Bytes the cache needs besides the blocks (kvforge: the fp16 tail pages)."""
        return 0.0

    def capacity(self, budget_bytes: float, max_seqs: int) -> Tuple[int, int]:
        n = int((budget_bytes - self.fixed_bytes(max_seqs)) // self.block_bytes())
        return self.block_tokens(), max(0, n)

    def bytes_per_token(self) -> float:
        """Device bytes per cached token (all layers and kv heads of this rank), blocks only."""
        return self.block_bytes() / self.block_tokens()

    # lifetime -------------------------------------------------------------------------
    def allocate(self, num_blocks: int, max_seqs: int) -> None:
        raise NotImplementedError

    def new_seq(self, req) -> None:
        pass

    def free_seq(self, req) -> None:
        pass

    def fill_synthetic(self, reqs, length: int, gen) -> None:
        """Gives each request ``length`` cached tokens of random K/V without a prefill (steady
        state measurements at long contexts)."""
        raise NotImplementedError

    # attention ------------------------------------------------------------------------
    def begin_step(self, reqs) -> Any:
        return reqs

    def prefill(self, layer: int, req, q, k, v):
        out = causal_attention(q, k, v)
        self.write_prompt(layer, req, k, v)
        return out

    def write_prompt(self, layer: int, req, k, v) -> None:
        raise NotImplementedError

    def decode(self, layer: int, md, q, k, v):
        self.write_step(layer, md, k, v)
        return self.attend(layer, md, q)

    def write_step(self, layer: int, md, k, v) -> None:
        """The batch's new tokens (one per sequence) into the cache."""
        raise NotImplementedError

    def attend(self, layer: int, md, q):
        """One query per sequence against its cache (the new token included)."""
        raise NotImplementedError

    # CUDA graphs ----------------------------------------------------------------------
    def graph_capable(self) -> bool:
        """Whether a decode step of this backend can be captured (module docs)."""
        return False

    def graph_prepare(self, reqs) -> Optional[Any]:
        raise NotImplementedError

    def graph_decode(self, layer: int, q, k, v, stream: int):
        raise NotImplementedError

    def graph_commit(self, reqs) -> None:
        pass

    def describe(self) -> Dict[str, Any]:
        return {"backend": self.name, "bytes_per_token": self.bytes_per_token(), "block_tokens": self.block_tokens()}


class _TokenSlots:
    """Shared helpers of backends whose block ids are slots of a torch tensor pool."""

    def slots(self, req, start: int, n: int):
        """(block index, slot in block) of tokens [start, start + n) of ``req`` as long tensors."""
        bt = self.block_tokens()
        pos = torch.arange(start, start + n, device=self.device)
        table = torch.tensor(req.blocks, device=self.device, dtype=torch.long)
        return table[pos // bt], pos % bt

    def step_slots(self, reqs):
        """(block, slot) of each request's newest token (position ``req.length - 1``)."""
        bt = self.block_tokens()
        blk = [r.blocks[(r.length - 1) // bt] for r in reqs]
        slot = [(r.length - 1) % bt for r in reqs]
        return (torch.tensor(blk, device=self.device, dtype=torch.long), torch.tensor(slot, device=self.device, dtype=torch.long))


class SdpaBackend(_TokenSlots, Backend):
    """Dense fp16 K/V per sequence in one contiguous slab of blocks, per layer
    ``[blocks * block_tokens, Hkv, D]``; decode calls torch SDPA once per sequence with the
    GQA group folded into the query length (exact for one query token)."""

    name = "sdpa"
    contiguous = True

    def __init__(self, *a, block: int = 16, **kw):
        super().__init__(*a, **kw)
        self._bt = block

    def block_tokens(self):
        return self._bt

    def block_bytes(self):
        return self._bt * self.layers * self.hkv * self.d * 2 * 2

    def allocate(self, num_blocks, max_seqs):
        n = num_blocks * self._bt
        self.k = [torch.zeros(n, self.hkv, self.d, dtype=torch.float16, device=self.device) for _ in range(self.layers)]
        self.v = [torch.zeros(n, self.hkv, self.d, dtype=torch.float16, device=self.device) for _ in range(self.layers)]

    def fill_synthetic(self, reqs, length, gen):
        for t in self.k + self.v:
            fill_random_(t, gen)

    def write_prompt(self, layer, req, k, v):
        s = req.blocks[0] * self._bt
        self.k[layer][s:s + k.shape[0]] = k
        self.v[layer][s:s + v.shape[0]] = v

    def begin_step(self, reqs):
        blk, slot = self.step_slots(reqs)
        return {"reqs": reqs, "rows": blk * self._bt + slot, "spans": [(r.blocks[0] * self._bt, r.length) for r in reqs]}

    def write_step(self, layer, md, k, v):
        self.k[layer][md["rows"]] = k
        self.v[layer][md["rows"]] = v

    def attend(self, layer, md, q):
        kc, vc = self.k[layer], self.v[layer]
        out = torch.empty_like(q)
        for b, (s, n) in enumerate(md["spans"]):
            qb = q[b].view(self.hkv, self.g, self.d)[None]
            kb = kc[s:s + n].transpose(0, 1)[None]
            vb = vc[s:s + n].transpose(0, 1)[None]
            out[b] = F.scaled_dot_product_attention(qb, kb, vb)[0].reshape(self.hq, self.d)
        return out


class FlashInferBackend(_TokenSlots, Backend):
    """FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, NHD): per layer a
    ``[num_blocks, 2, page, Hkv, D]`` cache in fp16 or fp8 e4m3 (scale 1, as vLLM's
    ``kv_cache_dtype="fp8"`` without calibration); one ``plan`` per step shared by the layers
    (the page table is the same for every layer), one ``run`` per layer. New tokens are
    written with one indexed store per layer (vLLM's ``reshape_and_cache``)."""

    def __init__(self, *a, kv_dtype: str = "fp16", page: int = 16, tensor_cores: bool = True, workspace_mb: int = 256, **kw):
        super().__init__(*a, **kw)
        self.kv_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.float16
        self.name = "flashinfer_fp8" if kv_dtype == "fp8" else "flashinfer"
        self.page, self.tensor_cores, self.workspace_mb = page, tensor_cores, workspace_mb

    def block_tokens(self):
        return self.page

    def block_bytes(self):
        return self.page * self.layers * self.hkv * self.d * 2 * (1 if self.kv_dtype == torch.float8_e4m3fn else 2)

    def allocate(self, num_blocks, max_seqs):
        import flashinfer

        self.fi = flashinfer
        self.num_blocks = num_blocks
        self.cache = [torch.zeros(num_blocks, 2, self.page, self.hkv, self.d, dtype=self.kv_dtype, device=self.device) for _ in range(self.layers)]
        self.ws = torch.zeros(self.workspace_mb << 20, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.ws, "NHD", use_tensor_cores=self.tensor_cores)
        self._gw = None  # the CUDA-graph wrapper, made for the first captured batch size

    def fill_synthetic(self, reqs, length, gen):
        for c in self.cache:
            fill_random_(c, gen)

    def _store(self, layer, blk, slot, k, v):
        """cache[blk, 0 / 1, slot] = k / v in the cache dtype (fp8 through a byte view: indexed
        stores of float8 tensors are not implemented everywhere)."""
        c = self.cache[layer]
        if self.kv_dtype == torch.float16:
            c[:, 0][blk, slot] = k
            c[:, 1][blk, slot] = v
        else:
            cb = c.view(torch.uint8)
            cb[:, 0][blk, slot] = k.to(self.kv_dtype).view(torch.uint8)
            cb[:, 1][blk, slot] = v.to(self.kv_dtype).view(torch.uint8)

    def write_prompt(self, layer, req, k, v):
        blk, slot = self.slots(req, 0, k.shape[0])
        self._store(layer, blk, slot, k, v)

    def _page_table(self, reqs):
        """(indptr, indices, last page lengths) of the step. The padded block table of the batch
        lives on the device and is rebuilt only when the batch changes; per step only the
        lengths travel."""
        ps, dev = self.page, self.device
        key = tuple(r.rid for r in reqs)
        if getattr(self, "_key", None) != key:
            width = max(len(r.blocks) for r in reqs)
            tbl = torch.zeros(len(reqs), width, dtype=torch.int32)
            for i, r in enumerate(reqs):
                tbl[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
            self._key, self._tbl = key, tbl.to(dev)
            self._cols = torch.arange(width, device=dev)
        lens = torch.tensor([r.length for r in reqs], dtype=torch.int32)
        npages = (lens + ps - 1) // ps
        indptr = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(npages, 0)
        last = lens - (npages - 1) * ps
        indices = self._tbl[self._cols[None, :] < npages.to(dev)[:, None]]
        # indptr / last page lengths as host tensors: plan() reads them on the host anyway
        return indptr, indices, last

    def _plan(self, wrapper, reqs):
        indptr, indices, last = self._page_table(reqs)
        wrapper.plan(indptr, indices, last, self.hq, self.hkv, self.d, self.page,
                     pos_encoding_mode="NONE", q_data_type=torch.float16, kv_data_type=self.kv_dtype)

    def begin_step(self, reqs):
        """Plans the step once for every layer."""
        self._plan(self.wrapper, reqs)
        blk, slot = self.step_slots(reqs)
        return {"blk": blk, "slot": slot}

    def write_step(self, layer, md, k, v):
        self._store(layer, md["blk"], md["slot"], k, v)

    def attend(self, layer, md, q):
        return self.wrapper.run(q, self.cache[layer])

    # CUDA graphs: a ``use_cuda_graph=True`` wrapper over fixed page-table buffers (planned
    # before every replay, as SGLang's FlashInfer backend does), the write slots in fixed
    # index tensors.
    def graph_capable(self):
        return self.device.type == "cuda"

    def _graph_wrapper(self, batch: int):
        if self._gw is None or self._gw_batch != batch:
            i32, dev = torch.int32, self.device
            self._g_indptr = torch.zeros(batch + 1, dtype=i32, device=dev)
            self._g_indices = torch.zeros(max(1, self.num_blocks), dtype=i32, device=dev)
            self._g_last = torch.zeros(batch, dtype=i32, device=dev)
            self._g_blk = torch.zeros(batch, dtype=torch.long, device=dev)
            self._g_slot = torch.zeros(batch, dtype=torch.long, device=dev)
            self._g_ws = torch.zeros(self.workspace_mb << 20, dtype=torch.uint8, device=dev)
            self._gw = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self._g_ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores, paged_kv_indptr_buffer=self._g_indptr,
                paged_kv_indices_buffer=self._g_indices, paged_kv_last_page_len_buffer=self._g_last)
            self._gw_batch = batch
        return self._gw

    def graph_prepare(self, reqs):
        gw = self._graph_wrapper(len(reqs))
        self._plan(gw, reqs)
        blk, slot = self.step_slots(reqs)
        self._g_blk.copy_(blk)
        self._g_slot.copy_(slot)
        # The plan's scalars are kernel arguments of the captured launch: a change (FlashInfer
        # keeps them fixed for a cuda-graph wrapper of one batch size) means capture again.
        info = getattr(gw, "_plan_info", None)
        try:
            info = tuple(int(x) for x in info)
        except (TypeError, ValueError):
            info = None
        return ("flashinfer", len(reqs), info)

    def graph_decode(self, layer, q, k, v, stream):
        self._store(layer, self._g_blk, self._g_slot, k, v)
        return self._gw.run(q, self.cache[layer])

    def describe(self):
        return {**super().describe(), "kv_dtype": str(self.kv_dtype).replace("torch.", ""), "tensor_cores": self.tensor_cores,
                "flashinfer": getattr(getattr(self, "fi", None), "__version__", None)}


class KvforgeBackend(Backend):
    """kvforge's paged, tiered cache through the Python package: one ``kvforge.Cache`` per
    layer (``target_only=True``: the arena holds the fp16 tail pages and the target tier only),
    sized from the budget. Prompts attend exactly (SDPA on the fresh K/V) and are then
    appended on the device (``Cache.append_device``: full pages encoded to the tier). A decode
    step is one ``Cache.step`` call per layer: every sequence's new token appended (one
    launch) and the batch's queries decoded on the device-resident plan, into output buffers
    kept per layer, with torch's stream looked up once per step; wheels without ``step`` make
    two calls (``append_step``, ``decode``), wheels without ``append_step`` stage each token
    through the host (``Cache.append``). With ``--cuda-graph`` a step is
    ``Cache.graph_prepare`` / ``graph_launch`` (captured) / ``graph_commit`` per layer, as
    ``kvforge.hf.generate(cuda_graph=True)`` does. The scheduler's blocks mirror kvforge's full
    pages (64 tokens); kvforge allocates the real ones from its own pool, which the mirror keeps
    from running dry.
    """

    def __init__(self, *a, spec: str = "specs/rdkv.toml", tier: str = "b4", root: Optional[str] = None, writes: bool = True, **kw):
        super().__init__(*a, **kw)
        import kvforge

        self.kvforge, self.spec, self.tier, self.root = kvforge, spec, tier, root
        # writes=False (``kvforge:<tier>+nowrite``, steady mode only): decode steps do not
        # append, so every step attends the same cache: the model + kernels bound a device-side
        # append would reach, with today's host-staged Cache.append taken out.
        self.writes = writes
        self.name = f"kvforge:{tier}" + ("" if writes else "+nowrite")
        self._probe()
        # Decode steps append on the device (``Cache.append_step``, one launch per layer) where
        # the wheel has it; ``KVFORGE_SERVE_HOST_APPEND=1`` keeps the host-staged ``Cache.append``
        # per sequence (to size what the device append saves).
        self.device_append = hasattr(self.kvforge.Cache, "append_step") and os.environ.get("KVFORGE_SERVE_HOST_APPEND") != "1"
        # One call per layer and step (``Cache.step``: append + decode, outputs given) where the
        # wheel has it; ``KVFORGE_SERVE_SPLIT_STEP=1`` keeps the two calls (to size the saving).
        self.one_call = self.device_append and hasattr(self.kvforge.Cache, "step") and os.environ.get("KVFORGE_SERVE_SPLIT_STEP") != "1"
        self._bufs: Dict[int, Tuple[Any, Any]] = {}
        self._stream: Optional[int] = None

    def _cache(self, max_tokens: int, sequences: int):
        kw = dict(head_dim=self.d, num_kv_heads=self.hkv, gqa=self.g, max_tokens=max_tokens, sequences=sequences, target=self.tier,
                  root=self.root, device=self.device.index or 0)
        try:
            return self.kvforge.Cache(self.spec, target_only=True, **kw), True
        except TypeError:  # a wheel without target_only: every ladder tier gets pages
            return self.kvforge.Cache(self.spec, **kw), False

    def _probe(self):
        """Page bytes of the target tier and of the fp16 tail, read off a one-page cache."""
        c, self.target_only = self._cache(128, 1)
        self.pt = c.page_tokens
        s = c.add_sequence()
        x = torch.randn(self.pt + 1, self.hkv, self.d, dtype=torch.float16, device=self.device)
        c.append(s, x, x)
        rep = {u["tier"]: u for u in c.memory_report()}
        tail = [u for t, u in rep.items() if t != self.tier and u["pages"] > 0]
        self.page_bytes = rep[self.tier]["resident_bytes"] / self.hkv
        self.tail_bytes = tail[0]["resident_bytes"] / self.hkv if tail else self.page_bytes
        del c

    def block_tokens(self):
        return self.pt

    def block_bytes(self):
        return self.page_bytes * self.layers * self.hkv

    def fixed_bytes(self, max_seqs):
        # per layer and kv head: (sequences + 64) tail pages, and `sequences` spare target
        # pages (CacheConfig's rounding)
        return self.layers * self.hkv * ((max_seqs + 64) * self.tail_bytes + max_seqs * self.page_bytes)

    def allocate(self, num_blocks, max_seqs):
        self.caches = [self._cache(num_blocks * self.pt, max_seqs)[0] for _ in range(self.layers)]
        self.ids: Dict[int, int] = {}

    def new_seq(self, req):
        ids = {c.add_sequence() for c in self.caches}
        if len(ids) != 1:
            raise RuntimeError(f"kvforge backend: layers gave different sequence ids {ids}")
        self.ids[req.rid] = ids.pop()

    def free_seq(self, req):
        s = self.ids.pop(req.rid)
        for c in self.caches:
            c.remove_sequence(s)

    def fill_synthetic(self, reqs, length, gen):
        """A template sequence of random K/V appended per layer, then tiled on the device
        (``Cache.tile_sequence``) into every request: needs a fresh cache."""
        p = self.pt
        full = length // p
        t = max((t for t in range(1, min(full, 16) + 1) if full % t == 0), default=0)
        tl = t * p + length % p
        ids = None
        for c in self.caches:
            s0 = c.add_sequence()
            k = torch.randn(tl, self.hkv, self.d, dtype=torch.float16, device=self.device, generator=gen)
            v = torch.randn(tl, self.hkv, self.d, dtype=torch.float16, device=self.device, generator=gen)
            c.append(s0, k, v)
            got = c.tile_sequence(s0, len(reqs), length)
            if ids is not None and got != ids:
                raise RuntimeError("kvforge backend: layers tiled to different sequence ids")
            ids = got
        self.ids = {r.rid: i for r, i in zip(reqs, ids)}

    def write_prompt(self, layer, req, k, v):
        # The prompt is written on the device (``Cache.append_device``: one append launch and one
        # encode launch per batch of pages) where the wheel has it, else staged through the host.
        c = self.caches[layer]
        write = c.append_device if self.device_append and hasattr(c, "append_device") else c.append
        write(self.ids[req.rid], k.contiguous(), v.contiguous())

    def begin_step(self, reqs):
        # torch's current stream, looked up once per step for every layer's call
        self._stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else None
        return [self.ids[r.rid] for r in reqs]

    def _outputs(self, layer, q):
        """The layer's (out [B, Hq, D], lse [B, Hq] float32), made once per batch size and
        reused: the model consumes a layer's output before its next step writes it (one
        stream), and a captured graph keeps writing the same ones."""
        b = q.shape[0]
        bufs = self._bufs.get(layer)
        if bufs is None or bufs[0].shape[0] != b:
            bufs = (torch.empty(b, self.hq, self.d, dtype=q.dtype, device=q.device), torch.empty(b, self.hq, dtype=torch.float32, device=q.device))
            self._bufs[layer] = bufs
        return bufs

    def decode(self, layer, md, q, k, v):
        if self.writes and self.one_call:
            out, lse = self._outputs(layer, q)
            self.caches[layer].step(md, k.contiguous(), v.contiguous(), q.contiguous(), out=out, lse=lse, stream=self._stream)
            return out
        return super().decode(layer, md, q, k, v)

    def write_step(self, layer, md, k, v):
        if not self.writes:
            return
        c = self.caches[layer]
        if self.device_append:
            # One launch for the batch (issue 29): no host staging per sequence.
            c.append_step(md, k.contiguous(), v.contiguous())
            return
        for b, s in enumerate(md):
            c.append(s, k[b:b + 1], v[b:b + 1])

    def attend(self, layer, md, q):
        out, _ = self.caches[layer].decode(q.contiguous(), seqs=md)
        return out

    # CUDA graphs: Cache.graph_prepare / graph_launch / graph_commit (crates/kvforge-rt/src/graph.rs)
    def graph_capable(self):
        return self.device.type == "cuda" and self.writes and self.one_call and hasattr(self.kvforge.Cache, "graph_launch")

    def graph_prepare(self, reqs):
        """Every layer's ``graph_prepare`` (new tail pages, the resident table synced, the
        append chunk list written): the tuple of their keys, or None where a layer's step
        fills a tail page (every layer then, as they hold the same lengths)."""
        seqs = self.begin_step(reqs)
        self._gseqs = seqs
        keys = tuple(c.graph_prepare(seqs, stream=self._stream) for c in self.caches)
        return None if any(k is None for k in keys) else keys

    def graph_decode(self, layer, q, k, v, stream):
        out, lse = self._outputs(layer, q)
        self.caches[layer].graph_launch(self._gseqs, k, v, q, out, lse, stream)
        return out

    def graph_commit(self, reqs):
        for c in self.caches:
            c.graph_commit(self._gseqs, stream=self._stream)

    def synchronize(self):
        """Raises the faults kernels flagged asynchronously (decode steps, replayed graphs)."""
        for c in getattr(self, "caches", []):
            if hasattr(c, "synchronize"):
                c.synchronize()

    def describe(self):
        return {**super().describe(), "spec": self.spec, "tier": self.tier, "page_bytes_per_head": self.page_bytes,
                "tail_page_bytes_per_head": self.tail_bytes, "target_only": self.target_only, "writes": self.writes,
                "device_append": self.device_append, "one_call_step": self.writes and self.one_call,
                "kvforge": getattr(self.kvforge, "__version__", None)}


def make_backend(name: str, layers: int, hq: int, hkv: int, d: int, device, root: Optional[str] = None, fi_tensor_cores: bool = True):
    """``sdpa``, ``flashinfer``, ``flashinfer_fp8``, ``kvforge:<tier>`` (a tier of
    ``specs/rdkv.toml``, ``specs/rotated.toml`` or ``specs/baseline.toml``, found by name) or
    ``kvforge:<spec.toml>:<tier>``; a ``+nowrite`` suffix on a kvforge name skips the per-step
    appends (steady mode: an upper bound without the host-staged writes)."""
    a = (layers, hq, hkv, d)
    if name == "sdpa":
        return SdpaBackend(*a, device=device)
    if name in ("flashinfer", "flashinfer_fp8"):
        return FlashInferBackend(*a, device=device, kv_dtype="fp8" if name.endswith("fp8") else "fp16", tensor_cores=fi_tensor_cores)
    if name.startswith("kvforge:"):
        writes = not name.endswith("+nowrite")
        parts = name.removesuffix("+nowrite").split(":")[1:]
        if len(parts) == 2:
            spec, tier = parts
        else:
            tier = parts[0]
            spec = {"fp16": "specs/baseline.toml", "b16": "specs/rdkv.toml"}.get(tier)
            if spec is None:
                spec = "specs/rotated.toml" if tier.startswith(("r", "k3")) else "specs/rdkv.toml"
        return KvforgeBackend(*a, device=device, spec=spec, tier=tier, root=root, writes=writes)
    raise ValueError(f"unknown backend {name!r} (sdpa, flashinfer, flashinfer_fp8, kvforge:<tier>, kvforge:<spec>:<tier>)")
