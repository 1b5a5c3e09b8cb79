"""Shared pieces of the quality benchmark: data, model loading, text preparation and the
pluggable attention backends (registered through transformers' attention interface).

Backends (``make_backend(name)``):

* ``fp16``                      exact reference: transformers' eager attention on the model's
                                K and V (what the issue's baseline numbers were measured with).
* ``sim:int8|int4|int2``        pure-torch simulation of the RDKV tiers b8/b4/b2 (specs/rdkv.toml).
* ``sim:<spec.toml>:<tier>``    pure-torch simulation of any int / spherical / fp16 tier of a
                                spec, mirroring kvforge-ref's arithmetic (see ``quantize_*``).
* ``sim:sph:<codebooks.safetensors>`` spherical keys with one codebook per (layer, kv head,
                                group) (``kvforge codebook train --per-head``), rotated first
                                when the file's ``basis`` says ``hadamard:<seed>`` (``sph.py``).
* ``kvforge:<spec.toml>:<tier>`` the kvforge Python extension: one ``kvforge.Cache`` per layer,
                                post-RoPE K/V appended (full pages encoded to ``tier``), queries
                                answered by ``attend_prefix`` (prompt) / ``decode`` (one token).
                                The logic is the package's transformers integration,
                                ``kvforge.hf.KvforgeAttention``; the attention function and the
                                no-op mask function registered here are ``kvforge.hf``'s too.

Paging semantics shared by ``sim`` and ``kvforge``: tokens live in pages of ``page.tokens`` (64);
every *full* page is stored in the target tier, the partly filled last page stays fp16 (the tail
tier). For a prompt of T tokens all T are appended first, then query i attends tokens 0..i of
that cache (so a page's quantisation statistics include its later tokens, as they would once
the page is full). Spherical radius scales are fixed per (layer, kv head, group) from the first
pages encoded (max radius x 1.25 / 255), as kvforge-rt does.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import tomllib
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
HF_SOURCE = ROOT / "crates" / "kvforge-py" / "python" / "kvforge" / "hf.py"


def _load_hf():
    """``kvforge.hf`` of the installed wheel; without one (CPU here), the same file from the
    source tree (it imports the ``kvforge`` extension only when a cache is made)."""
    try:
        from kvforge import hf
        return hf
    except ImportError:
        spec = importlib.util.spec_from_file_location("kvforge_hf_source", HF_SOURCE)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


hf = _load_hf()
DATA = ROOT / "data"
BOOKS = ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"]
CALIBRATION_BOOK = "emma"  # used by capture_keys.py only; never evaluated
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ATTN_NAME = "kvq_eval"


# ---------------------------------------------------------------------------------------------
# Text preparation (this exact recipe reproduces the fp16 baseline, see README)

def book_text(name: str, data: Path = DATA) -> str:
    """The novel as prepared by prepare.py: R's character vector, one element per line, '\\n'-joined."""
    return (data / "austen" / f"{name}.txt").read_text(encoding="utf-8")


def book_tokens(tok, name: str, data: Path = DATA) -> list[int]:
    """Token ids of the whole novel from its first line: no BOS or other special token."""
    return tok(book_text(name, data), add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------
# Model

def find_gguf(path: str | os.PathLike | None) -> Path:
    """A .gguf file, or a folder holding GGUF_NAME (default: data/model/ then /root/m)."""
    cands = [Path(path)] if path else [DATA / "model", Path("/root/m")]
    for c in cands:
        if c.is_file():
            return c
        if (c / GGUF_NAME).is_file():
            return c / GGUF_NAME
    raise SystemExit(f"no {GGUF_NAME} under {[str(c) for c in cands]}: run benches/quality/prepare.py (or pass --model)")


def load_model(gguf: Path, device: str, dtype: torch.dtype):
    """Loads SmolLM2 from its GGUF (transformers + the gguf package) with our attention hook."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_attention()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, attn_implementation="eager")
    model.to(device).eval()
    model.config._attn_implementation = ATTN_NAME  # every layer now calls dispatch() below
    return model, tok


# ---------------------------------------------------------------------------------------------
# Attention interface

_BACKEND = None  # the backend dispatch() sends every attention call to


def set_backend(backend) -> None:
    global _BACKEND
    _BACKEND = backend
    backend.reset()


# transformers attention function: q [B,Hq,Tq,D], k/v [B,Hkv,S,D] (post-RoPE, all cached
# tokens, queries are the last Tq positions) -> ([B,Tq,Hq,D], None); batch 1, sent to
# _BACKEND.attend(layer, q[0], k[0], v[0], scaling) (kvforge.hf's function, our resolver).
dispatch = hf.attention_function(lambda module: _BACKEND)


def register_attention() -> None:
    """``dispatch`` and kvforge.hf's mask function (none built: backends apply causality)."""
    hf.register(ATTN_NAME, dispatch)


def eager_causal(q, k, v, scaling):
    """transformers' eager attention, causal with queries at the last Tq of S positions.
    q [Hq,Tq,D], k/v [Hkv,S,D] in the model dtype; returns [Tq,Hq,D]."""
    hq, tq, _ = q.shape
    hkv, s, _ = k.shape
    g = hq // hkv
    ks = k.repeat_interleave(g, dim=0)
    vs = v.repeat_interleave(g, dim=0)
    w = torch.matmul(q, ks.transpose(1, 2)) * scaling
    if tq > 1:
        i = torch.arange(tq, device=q.device)[:, None] + (s - tq)
        j = torch.arange(s, device=q.device)[None, :]
        w = w.masked_fill(j > i, torch.finfo(w.dtype).min)
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, vs).transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------------------------
# Quantisers (torch mirrors of crates/kvforge-ref/src/quant.rs and spherical.rs)

def _round_scale(x: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32) if scale_dtype == "fp16" else x


def int_quantize(x: torch.Tensor, bits: int, dim: int, scale_dtype: str) -> torch.Tensor:
    """Asymmetric min/max quantisation of ``x`` (f32) with one step per slice along ``dim``:
    scale = S((mx-mn)/qmax), zero = S(mn), code = clamp(floor((x-zero)/scale+0.5), 0, qmax),
    0 where scale == 0; returns code*scale+zero."""
    qmax = float(2**bits - 1)
    mn = x.amin(dim=dim, keepdim=True)
    mx = x.amax(dim=dim, keepdim=True)
    scale = _round_scale((mx - mn) / qmax, scale_dtype)
    zero = _round_scale(mn, scale_dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    code = torch.floor((x - zero) / safe + 0.5).clamp(0, qmax)
    code = torch.where(scale == 0, torch.zeros_like(code), code)
    return code * scale + zero


def quantize_int_keys(k: torch.Tensor, bits: int, block: int, scale_dtype: str) -> torch.Tensor:
    """Per-channel keys: k [H, T, D] with T a multiple of block; one step per (block, channel)."""
    h, t, d = k.shape
    kb = k.reshape(h, t // block, block, d)
    return int_quantize(kb, bits, 2, scale_dtype).reshape(h, t, d)


def quantize_int_values(v: torch.Tensor, bits: int, group: int, scale_dtype: str) -> torch.Tensor:
    """Per-token values: v [H, T, D]; one step per (token, group of channels)."""
    h, t, d = v.shape
    vg = v.reshape(h, t, d // group, group)
    return int_quantize(vg, bits, 3, scale_dtype).reshape(h, t, d)


def radius_scales(k: torch.Tensor, group: int, headroom: float = 1.25) -> torch.Tensor:
    """[H, D/group]: max over tokens of the group norm x headroom / 255 (1.0 for a zero group)."""
    h, t, d = k.shape
    r = k.reshape(h, t, d // group, group).norm(dim=3).amax(dim=1)
    return torch.where(r > 0, r * headroom / 255.0, torch.ones_like(r))


def quantize_spherical_keys(k: torch.Tensor, group: int, codebook: torch.Tensor, rscale: torch.Tensor) -> torch.Tensor:
    """Spherical keys: each group -> 8-bit radius code x nearest codeword (max cosine).
    k [H,T,D] f32, codebook [E, group] unit rows, rscale [H, D/group]."""
    h, t, d = k.shape
    g = k.reshape(h, t, d // group, group)
    r = g.norm(dim=3)
    u = g / (r[..., None] + 1e-6)
    idx = torch.matmul(u, codebook.T).argmax(dim=-1)  # ties: first index, as kvforge-ref
    rs = rscale[:, None, :]
    rcode = torch.floor(r / rs + 0.5).clamp(0, 255)
    return (codebook[idx] * (rcode * rs)[..., None]).reshape(h, t, d)


class TierSim:
    """Simulates one tier of a spec (keys and values) on [H, T, D] tensors of full pages."""

    def __init__(self, spec_path: Path, tier_name: str):
        spec_path = Path(spec_path)
        if not spec_path.is_absolute() and not spec_path.exists():
            spec_path = ROOT / spec_path
        spec = tomllib.loads(spec_path.read_text())
        tiers = {t["name"]: t for t in spec["tier"]}
        if tier_name not in tiers:
            raise SystemExit(f"{spec_path}: no tier `{tier_name}` (tiers: {list(tiers)})")
        self.tier = tiers[tier_name]
        self.page = int(spec.get("page", {}).get("tokens", 64))
        self.spec_name = spec["spec"]["name"]
        self.codebook = None
        key = self.tier["key"]
        if key["scheme"] == "spherical":
            from safetensors.torch import load_file

            path = (spec_path.parent / key["codebook"]).resolve()
            self.codebook = load_file(str(path))["codebook"].float()
        for part in ("key", "value"):
            if self.tier[part]["scheme"] in ("drop",):
                raise SystemExit(f"sim: tier `{tier_name}` drops tokens; only storing tiers can be simulated")

    def keys(self, k: torch.Tensor, rscale=None) -> torch.Tensor:
        s = self.tier["key"]
        if s["scheme"] in ("fp16", "bf16"):
            return k
        if s["scheme"] == "int":
            return quantize_int_keys(k, s["bits"], s.get("block", self.page), s.get("scale_dtype", "fp16"))
        if s["scheme"] == "spherical":
            return quantize_spherical_keys(k, s["group"], self.codebook.to(k.device), rscale)
        raise SystemExit(f"sim: key scheme {s['scheme']} not simulated")

    def values(self, v: torch.Tensor) -> torch.Tensor:
        s = self.tier["value"]
        if s["scheme"] in ("fp16", "bf16"):
            return v
        if s["scheme"] == "int":
            return quantize_int_values(v, s["bits"], s["group"], s.get("scale_dtype", "fp16"))
        raise SystemExit(f"sim: value scheme {s['scheme']} not simulated")

    def payload_bytes_per_token(self, d: int) -> float:
        """Bytes per token per kv head of K + V payload and metadata (no page headers)."""
        return _part_bytes(self.tier["key"], d, self.page, True) + _part_bytes(self.tier["value"], d, self.page, False)


def _part_bytes(s: dict, d: int, page: int, is_key: bool) -> float:
    sb = 2 if s.get("scale_dtype", "fp16") == "fp16" else 4
    if s["scheme"] in ("fp16", "bf16"):
        return 2.0 * d
    if s["scheme"] == "drop":
        return 0.0
    if s["scheme"] == "int":
        codes = d * s["bits"] / 8
        if is_key:
            return codes + 2 * sb * d / s.get("block", page)
        return codes + 2 * sb * d / s["group"]
    if s["scheme"] == "spherical":
        groups = d // s["group"]
        return groups + math.ceil(groups * s["angle_bits"] / 8)
    raise ValueError(s)


SIM_ALIASES = {"int8": ("specs/rdkv.toml", "b8"), "int4": ("specs/rdkv.toml", "b4"), "int2": ("specs/rdkv.toml", "b2")}


# ---------------------------------------------------------------------------------------------
# Backends

class Fp16Backend:
    """Exact reference: the model's own K/V through transformers-style eager attention."""

    name = "fp16"
    measured_bytes = False

    def reset(self):
        pass

    def attend(self, layer, q, k, v, scaling):
        return eager_causal(q, k, v, scaling)

    def bytes_per_token(self, d: int) -> float:
        return 4.0 * d  # fp16 K + V

    def describe(self):
        return {"kind": "fp16", "bytes_source": "computed: fp16 K+V payload"}


class SimBackend:
    """Dequantised K/V of every full page (tail page fp16), then eager attention."""

    measured_bytes = False

    def __init__(self, spec: str, tier: str, name: str):
        self.name = name
        self.spec, self.tier_name = spec, tier
        self.sim = TierSim(Path(spec), tier)
        self.rscale = {}

    def reset(self):
        self.rscale = {}

    def attend(self, layer, q, k, v, scaling):
        s = k.shape[1]
        full = (s // self.sim.page) * self.sim.page
        if full == 0:
            return eager_causal(q, k, v, scaling)
        kf, vf = k[:, :full].float(), v[:, :full].float()
        rs = None
        if self.sim.tier["key"]["scheme"] == "spherical":
            if layer not in self.rscale:  # fixed from the first pages encoded, as kvforge-rt
                self.rscale[layer] = radius_scales(kf, self.sim.tier["key"]["group"])
            rs = self.rscale[layer]
        kq = torch.cat([self.sim.keys(kf, rs).to(k.dtype), k[:, full:]], dim=1)
        vq = torch.cat([self.sim.values(vf).to(v.dtype), v[:, full:]], dim=1)
        return eager_causal(q, kq, vq, scaling)

    def bytes_per_token(self, d: int) -> float:
        return self.sim.payload_bytes_per_token(d)

    def describe(self):
        return {"kind": "sim", "spec": self.spec, "tier": self.tier_name, "tier_def": self.sim.tier,
                "bytes_source": "computed: payload + scales of full pages, no page headers or tail"}


class SphSimBackend:
    """Spherical keys with per-(layer, kv head, group) codebooks (``sim:sph:<file>``, a
    ``kvforge codebook train --per-head`` or ``sph_study.py --save-codebooks`` file; its
    metadata ``basis`` ``hadamard:<seed>`` rotates every key before grouping and back after
    dequantisation, which leaves q·k as a kernel rotating q would see it), fp16 values, 8-bit
    radius with scales fixed from the first pages; tail page fp16."""

    measured_bytes = False

    def __init__(self, path: str, name: str):
        import sph

        self.sph, self.name, self.path = sph, name, path
        p = Path(path)
        if not p.is_absolute() and not p.exists():
            p = ROOT / p
        self.cbs, self.meta = sph.load_per_head(p)  # [L, H, G, E, group]
        basis = self.meta.get("basis", "identity")
        self.rot_seed = int(basis.split(":", 1)[1], 0) if basis.startswith("hadamard:") else None
        self.group, self.entries = self.cbs.shape[-1], self.cbs.shape[-2]
        self.page = 64
        self.rscale = {}

    def reset(self):
        self.rscale = {}

    def attend(self, layer, q, k, v, scaling):
        s = k.shape[1]
        full = (s // self.page) * self.page
        if full == 0:
            return eager_causal(q, k, v, scaling)
        kf = k[:, :full].float()
        if self.rot_seed is not None:
            kf = self.sph.rotate(kf, self.rot_seed)
        if layer not in self.rscale:  # fixed from the first pages encoded, as kvforge-rt
            self.rscale[layer] = self.sph.radius_scales(kf, self.group)
        kq = self.sph.quantize_keys(kf, self.cbs[layer].to(kf.device), self.rscale[layer].to(kf.device))
        if self.rot_seed is not None:
            kq = self.sph.unrotate(kq, self.rot_seed)
        return eager_causal(q, torch.cat([kq.to(k.dtype), k[:, full:]], dim=1), v, scaling)

    def bytes_per_token(self, d: int) -> float:
        groups = d // self.group
        return groups + math.ceil(groups * math.log2(self.entries) / 8) + 2.0 * d

    def describe(self):
        return {"kind": "sim", "codebooks": str(self.path), "group": self.group, "entries": self.entries,
                "basis": self.meta.get("basis", "identity"), "trained_on": self.meta.get("trained_on"),
                "bytes_source": "computed: 8-bit radius + packed index per group + fp16 values, no page headers or tail"}


class KvforgeBackend(hf.KvforgeAttention):
    """kvforge.Cache per layer (GPU only): kvforge.hf.KvforgeAttention, specs under ROOT."""

    measured_bytes = True

    def __init__(self, spec: str, tier: str, name: str, max_tokens: int = 8192 + 256, **kw):
        try:
            import kvforge
        except ImportError as e:  # the rest of the harness works without the extension
            raise SystemExit(f"backend {name}: cannot import kvforge ({e}); install the wheel (see README)") from e
        # kw: control= / certify= / exact_prefill= of kvforge.hf.KvforgeAttention
        super().__init__(spec, tier, root=str(ROOT), max_tokens=max_tokens, module=kvforge, **kw)
        self.name = name

    def bytes_per_token(self, d: int | None = None) -> float:
        return super().bytes_per_token()

    def describe(self):
        return {**super().describe(),
                "bytes_source": "measured: Cache.bytes_per_token() (resident, headers and tail page included), mean over layers"}


class CompareBackend:
    """Runs the reference and a candidate on the same q/k/v; returns the reference output
    (so every layer sees exact inputs) and records per-layer relative error."""

    def __init__(self, ref, cand):
        self.ref, self.cand = ref, cand
        self.name = f"compare:{cand.name}"
        self.err = {}

    def reset(self):
        self.ref.reset()
        self.cand.reset()
        self.err = {}

    def attend(self, layer, q, k, v, scaling):
        o_ref = self.ref.attend(layer, q, k, v, scaling)
        o_c = self.cand.attend(layer, q, k, v, scaling)
        num = (o_c.float() - o_ref.float()).norm().item()
        den = o_ref.float().norm().item()
        self.err[layer] = num / den if den > 0 else float("nan")
        return o_ref


def make_backend(name: str, max_tokens: int = 8192 + 256):
    if name == "fp16":
        return Fp16Backend()
    kind, _, rest = name.partition(":")
    if kind == "sim" and rest.startswith("sph:"):
        return SphSimBackend(rest[4:], name)
    if kind == "sim":
        if rest in SIM_ALIASES:
            spec, tier = SIM_ALIASES[rest]
        else:
            spec, _, tier = rest.rpartition(":")
        return SimBackend(spec, tier, name)
    if kind == "kvforge":
        spec, _, tier = rest.rpartition(":")
        if rest in SIM_ALIASES:
            spec, tier = SIM_ALIASES[rest]
        return KvforgeBackend(spec, tier, name, max_tokens)
    raise SystemExit(f"unknown backend `{name}`: fp16 | sim:int8|int4|int2 | sim:<spec>:<tier> | kvforge:<spec>:<tier>")


def log(*a):
    print(*a, file=sys.stderr, flush=True)
