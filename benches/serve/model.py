"""A Llama decoder stack for the serving loop, tensor parallel over kv heads.

Pre-norm blocks (RMSNorm → attention with RoPE → residual → RMSNorm → SwiGLU MLP →
residual), tied or separate LM head. Under tensor parallelism (``torch.distributed``
initialised, world size W) each rank holds Hq/W query heads and Hkv/W kv heads (the Q/K/V
projections split by columns, the output projection by rows), I/W of the MLP's intermediate
(gate/up by columns, down by rows), and all-reduces after the output projection and after the
down projection, as vLLM's ``QKVParallelLinear`` / ``RowParallelLinear`` and SGLang do.
Embedding and LM head are replicated, so every rank samples the same token.

Weights are random (``LlamaConfig.llama3_8b``: Hq 32, Hkv 8, D 128, hidden 4096, MLP 14336,
a configurable number of layers; N(0, 1/fan_in)) or copied from a transformers Llama model
(``from_hf``, SmolLM2-135M for the quality check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab: int = 32000
    hidden: int = 4096
    layers: int = 8
    hq: int = 32
    hkv: int = 8
    d: int = 128
    inter: int = 14336
    rope_theta: float = 500000.0
    eps: float = 1e-5
    tied: bool = True

    @staticmethod
    def llama3_8b(layers: int = 8) -> "LlamaConfig":
        return LlamaConfig(layers=layers)

    @staticmethod
    def tiny(layers: int = 2) -> "LlamaConfig":
        return LlamaConfig(vocab=97, hidden=64, layers=layers, hq=8, hkv=2, d=16, inter=96, rope_theta=10000.0)


def tp_info():
    """(rank, world size, process group or None)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    return 0, 1, None


class Llama:
    def __init__(self, cfg: LlamaConfig, device, dtype=torch.float16, seed: int = 0, weights: Optional[dict] = None):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.rank, self.world, self.group = tp_info()
        w = self.world
        if cfg.hkv % w or cfg.inter % w:
            raise ValueError(f"tensor parallel over {w} ranks needs Hkv {cfg.hkv} and the MLP width {cfg.inter} divisible by {w}")
        self.hq, self.hkv, self.inter = cfg.hq // w, cfg.hkv // w, cfg.inter // w
        d = cfg.d
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        if weights is not None:
            self.w = weights
            return
        # Every rank draws the full matrices from one seed and keeps its shard, so a TP run
        # computes what a single-GPU run of the same seed does.
        g = torch.Generator(device=self.device).manual_seed(seed)

        def rnd(*shape, fan_in):
            return torch.randn(*shape, device=self.device, dtype=dtype, generator=g) / math.sqrt(fan_in)

        h, r = cfg.hidden, self.rank
        qs = slice(r * self.hq * d, (r + 1) * self.hq * d)
        ks = slice(r * self.hkv * d, (r + 1) * self.hkv * d)
        ms = slice(r * self.inter, (r + 1) * self.inter)
        self.w = {"embed": rnd(cfg.vocab, h, fan_in=1), "norm": torch.ones(h, device=self.device, dtype=dtype), "layers": []}
        for _ in range(cfg.layers):
            wq, wk, wv = rnd(h, cfg.hq * d, fan_in=h), rnd(h, cfg.hkv * d, fan_in=h), rnd(h, cfg.hkv * d, fan_in=h)
            wo = rnd(cfg.hq * d, h, fan_in=cfg.hq * d)
            wg, wu, wd = rnd(h, cfg.inter, fan_in=h), rnd(h, cfg.inter, fan_in=h), rnd(cfg.inter, h, fan_in=cfg.inter)
            self.w["layers"].append({
                "ln1": torch.ones(h, device=self.device, dtype=dtype), "ln2": torch.ones(h, device=self.device, dtype=dtype),
                "wqkv": torch.cat([wq[:, qs], wk[:, ks], wv[:, ks]], 1).contiguous(), "wo": wo[qs].contiguous(),
                "wgu": torch.cat([wg[:, ms], wu[:, ms]], 1).contiguous(), "wd": wd[ms].contiguous(),
            })
            del wq, wk, wv, wo, wg, wu, wd
        self.w["lm_head"] = self.w["embed"]

    @staticmethod
    def from_hf(model, device) -> "Llama":
        """A transformers Llama model's weights (single rank), e.g. SmolLM2-135M."""
        c = model.config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        cfg = LlamaConfig(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers, hq=c.num_attention_heads,
                          hkv=c.num_key_value_heads, d=d, inter=c.intermediate_size, rope_theta=float(theta),
                          eps=c.rms_norm_eps, tied=bool(getattr(c, "tie_word_embeddings", False)))
        m = model.model
        dt = torch.float16
        w = {"embed": m.embed_tokens.weight.detach().to(device, dt), "norm": m.norm.weight.detach().to(device, dt), "layers": []}
        for L in m.layers:
            a, mlp = L.self_attn, L.mlp
            w["layers"].append({
                "ln1": L.input_layernorm.weight.detach().to(device, dt), "ln2": L.post_attention_layernorm.weight.detach().to(device, dt),
                "wqkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach().t().contiguous().to(device, dt),
                "wo": a.o_proj.weight.detach().t().contiguous().to(device, dt),
                "wgu": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0).detach().t().contiguous().to(device, dt),
                "wd": mlp.down_proj.weight.detach().t().contiguous().to(device, dt),
            })
        w["lm_head"] = model.lm_head.weight.detach().to(device, dt)
        return Llama(cfg, device, weights=w)

    # pieces -----------------------------------------------------------------------------
    def _norm(self, x, wt):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(x.dtype) * wt

    def _rope(self, x, pos):
        """x [T, H, D], pos [T] (long): rotate-half RoPE as transformers' Llama."""
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
        xf = x.float()
        h = xf.shape[-1] // 2
        rot = torch.cat([-xf[..., h:], xf[..., :h]], -1)
        return (xf * cos + rot * sin).to(x.dtype)

    def _allreduce(self, x):
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def _layer(self, i, x, pos, attend):
        lw, d = self.w["layers"][i], self.cfg.d
        t = x.shape[0]
        qkv = self._norm(x, lw["ln1"]) @ lw["wqkv"]
        q = qkv[:, :self.hq * d].view(t, self.hq, d)
        k = qkv[:, self.hq * d:(self.hq + self.hkv) * d].view(t, self.hkv, d)
        v = qkv[:, (self.hq + self.hkv) * d:].reshape(t, self.hkv, d).contiguous()
        q, k = self._rope(q, pos).contiguous(), self._rope(k, pos).contiguous()
        o = attend(i, q, k, v)
        x = x + self._allreduce(o.reshape(t, self.hq * d) @ lw["wo"])
        hgu = self._norm(x, lw["ln2"]) @ lw["wgu"]
        hmid = F.silu(hgu[:, :self.inter]) * hgu[:, self.inter:]
        return x + self._allreduce(hmid @ lw["wd"])

    def _logits(self, x):
        return self._norm(x, self.w["norm"]) @ self.w["lm_head"].t()

    # passes -----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, backend, req, tokens: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """One prompt ``tokens [L]``: exact causal attention, its K/V written to ``backend``;
        returns the last position's logits [vocab] (float32)."""
        x = self.w["embed"][tokens]
        pos = torch.arange(tokens.shape[0], device=self.device)
        for i in range(self.cfg.layers):
            x = self._layer(i, x, pos, lambda l, q, k, v: backend.prefill(l, req, q, k, v))
        return self._logits(x[-1:]).float()[0]

    @torch.inference_mode()
    def decode(self, backend, md, tokens: torch.Tensor, pos: torch.Tensor, timers=None) -> torch.Tensor:
        """One token per sequence of the batch: ``tokens [B]`` at positions ``pos [B]``;
        returns logits [B, vocab] (float32)."""
        if timers is None:
            def attend(l, q, k, v):
                return backend.decode(l, md, q, k, v)
        else:
            def attend(l, q, k, v):
                return timers.decode(backend, l, md, q, k, v)
        return self.decode_with(attend, tokens, pos)

    @torch.inference_mode()
    def decode_with(self, attend, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``decode`` with the attention given as ``attend(layer, q, k, v) -> out`` (a CUDA
        graph capture passes the backend's ``graph_decode``)."""
        x = self.w["embed"][tokens]
        for i in range(self.cfg.layers):
            x = self._layer(i, x, pos, attend)
        return self._logits(x).float()

    @torch.inference_mode()
    def reference_greedy(self, prompt: List[int], n: int) -> List[int]:
        """Greedy continuation by full recomputation (no cache), exact attention: the check of
        the paged loop on small models."""
        ids = list(prompt)
        out = []
        for _ in range(n):
            t = torch.tensor(ids, device=self.device)
            x = self.w["embed"][t]
            pos = torch.arange(len(ids), device=self.device)
            from backends import causal_attention

            for i in range(self.cfg.layers):
                x = self._layer(i, x, pos, lambda l, q, k, v: causal_attention(q, k, v))
            nxt = int(self._logits(x[-1:]).float()[0].argmax())
            out.append(nxt)
            ids.append(nxt)
        return out
