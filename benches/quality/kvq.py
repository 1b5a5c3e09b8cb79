"""Shared pieces of the quality benchmark: data, model loading, text preparation and the
pluggable attention backends (registered through transformers' attention interface).

Backends (``make_backend(name)``):

* ``fp16``                      exact reference: transformers' eager attention on the model's
                                K and V (what the issue's baseline numbers were measured with).
* ``sim:int8|int4|int2``        pure-torch simulation of the RDKV tiers b8/b4/b2 (specs/rdkv.toml).
* ``sim:<spec.toml>:<tier>``    pure-torch simulation of any int / spherical / rotated / fp16 tier
                                of a spec, mirroring kvforge-ref's arithmetic (see ``quantize_*``,
                                ``rotated_quantize``).
* ``sim:fp8|r4|r3|r2|...``      tiers of benches/quality/sim-tiers.toml: FlashInfer's fp8 e4m3 KV
                                cache, the rotated contract's tiers and variants outside it.
* ``sim:<tier>[-sink<N>][-win<W>]`` any sim tier with its first N tokens (attention sinks) and,
                                per query, its W most recent tokens kept at the tail's precision
                                (fp16; KIVI's full-precision residual), the rest in the tier:
                                sim-only ``sink_tokens`` / ``window_tokens`` (``sim_target``,
                                ``windowed_causal``), e.g. ``sim:r3-kcs-sink64-win128``.
* ``sim:sph:<codebooks.safetensors>`` spherical keys with one codebook per (layer, kv head,
                                group) (``kvforge codebook train --per-head``), rotated first
                                when the file's ``basis`` says ``hadamard:<seed>`` (``sph.py``).
* ``sim:kvtc-<ratio>[-zstd|-rans|-none][@<tag>]`` kvtc (seed 003, crates/kvforge-kvtc): the exact K/V of the
                                whole input (a capture forward, as a prefill makes them) packed by
                                the ``kvforge`` binary at that ratio with the calibration
                                ``$KVFORGE_KVTC_CAL`` and unpacked again (``kvforge pack`` /
                                ``unpack``: the Rust reference itself, no re-implementation);
                                attention then reads the restored cache. Bytes are the
                                container's, measured. ``@<tag>`` takes one point of a
                                ``kvforge calibrate`` grid instead: ``<stem>-<tag><ext>`` beside
                                ``$KVFORGE_KVTC_CAL`` (e.g. ``@ks0.35-dp256``).
* ``sim:paris-k<k>[-oracle]...`` ParisKV retrieval decode (seed 001, issue 27): every query
                                position attends over sinks + local + the top-k keys the
                                ParisKV pipeline retrieves per kv head for the GQA group's
                                summed query (``paris_sim.py``, a port of crates/kvforge-paris
                                checked against it); ``-oracle``: the exact top-k instead;
                                ``-qhead``: one retrieval per query head.
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
import re
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


def windowed_causal(q, kq, vq, kr, vr, scaling, window: int):
    """Causal attention where every query reads its ``window`` most recent positions from
    (kr, vr) and every older one from (kq, vq): query i (queries are the last Tq of S
    positions) scores key j with q·kr_j if i - window < j <= i, else q·kq_j, and mixes the
    values of the same set. One softmax over both sets, in one pass: the logits are chosen per
    (i, j) by a position mask, so row i is what a one-token decode step at position i sees
    when a cache keeps its last ``window`` tokens unquantised (KIVI's residual) and the rest
    in a tier (up to statistics the tier takes over a whole page or sequence, which the
    prompt's later tokens enter).
    q [Hq,Tq,D], k*/v* [Hkv,S,D] in the model dtype; returns [Tq,Hq,D]."""
    hq, tq, _ = q.shape
    hkv, s, _ = kq.shape
    g = hq // hkv
    i = torch.arange(tq, device=q.device)[:, None] + (s - tq)
    j = torch.arange(s, device=q.device)[None, :]
    recent = (j <= i) & (j > i - window)
    wq = torch.matmul(q, kq.repeat_interleave(g, dim=0).transpose(1, 2))
    wr = torch.matmul(q, kr.repeat_interleave(g, dim=0).transpose(1, 2))
    w = torch.where(recent, wr, wq) * scaling
    del wq, wr
    w = w.masked_fill(j > i, torch.finfo(w.dtype).min)
    p = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    del w
    pr = p * recent
    out = torch.matmul(p - pr, vq.repeat_interleave(g, dim=0)) + torch.matmul(pr, vr.repeat_interleave(g, dim=0))
    return out.transpose(0, 1).contiguous()


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


# ---------------------------------------------------------------------------------------------
# Rotated scalar-codebook codec (issue 26; the contract is /work/wt/ROTATED.md, mirrored by
# kvforge-spec's `rotated` codec and templates/include/kvforge/codecs/rotated.cuh)

ROT_DEFAULT_SEED = 0x5EED
_M32 = 0xFFFFFFFF


def rotation_signs(d: int, seed: int = ROT_DEFAULT_SEED) -> list[int]:
    """The random signs s_c (+1/-1) of channels 0..d-1: the contract's u32 integer hash."""
    out = []
    for c in range(d):
        h = (c ^ ((seed * 0x9E3779B9) & _M32)) & _M32
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & _M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & _M32
        h ^= h >> 16
        out.append(-1 if h & 1 else 1)
    return out


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform along the last dimension (a power of two),
    butterflies in the contract's order: len 1, 2, 4, .., d/2, (a, b) <- (a + b, a - b)."""
    d = x.shape[-1]
    y = x.clone()
    n = 1
    while n < d:
        y = y.reshape(*x.shape[:-1], d // (2 * n), 2, n)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
        n *= 2
    return y.reshape(x.shape)


def rotate(x: torch.Tensor, seed: int = ROT_DEFAULT_SEED) -> torch.Tensor:
    """y = R x = H diag(s) x / sqrt(d) along the last dimension."""
    d = x.shape[-1]
    s = torch.tensor(rotation_signs(d, seed), dtype=x.dtype, device=x.device)
    return fwht(x * s) * (1.0 / math.sqrt(d))


def unrotate(y: torch.Tensor, seed: int = ROT_DEFAULT_SEED) -> torch.Tensor:
    """x = R^T y = diag(s) H y / sqrt(d) (H is symmetric)."""
    d = y.shape[-1]
    s = torch.tensor(rotation_signs(d, seed), dtype=y.dtype, device=y.device)
    return fwht(y) * (1.0 / math.sqrt(d)) * s


_LEVELS_CACHE: dict = {}


def int8_grid(lv):
    """The stored levels of 2- and 3-bit rotated codes (layout 4, kvforge-spec
    `LevelTable::grid_log2`): the Lloyd-Max levels rounded to integers times 2^-k, k the largest
    exponent whose outermost integer stays within 127 (the decode scores them as int8)."""
    import numpy as np

    k = 0
    while round(abs(lv[-1]) * 2.0 ** (k + 1)) <= 127:
        k += 1
    return np.round(np.asarray(lv) * 2.0**k) / 2.0**k


def lloyd_max_levels(d: int, bits: int, density: str = "beta", grid: int = 1 << 20, iters: int = 20000):
    """Lloyd-Max levels (float64 numpy, increasing, symmetric) for one coordinate of a uniform
    random unit vector in R^d: f(u) ∝ (1 - u²)^((d-3)/2) on [-1, 1] (seed 001 Prop. 4.1), or
    ``density="gaussian"``: N(0, 1/d) (the large-d limit). Lloyd iterations on ``grid`` cell
    midpoints of [-1, 1]: thresholds are midpoints of adjacent levels, a level is the
    density-weighted mean of its cell; starts at the quantiles (i + 1/2)/E; symmetrised each
    step; stops when no level moves by more than 1e-14. Returns (levels, mse per coordinate)."""
    import numpy as np

    key = (d, bits, density, grid)
    if key in _LEVELS_CACHE:
        return _LEVELS_CACHE[key]
    e = 1 << bits
    u = (np.arange(grid, dtype=np.float64) + 0.5) * (2.0 / grid) - 1.0
    if density == "beta":
        logw = 0.5 * (d - 3) * np.log1p(-u * u)
    elif density == "gaussian":
        logw = -0.5 * d * u * u
    else:
        raise ValueError(density)
    w = np.exp(logw - logw.max())
    w /= w.sum()
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cwu = np.concatenate([[0.0], np.cumsum(w * u)])
    cwuu = np.concatenate([[0.0], np.cumsum(w * u * u)])
    lv = np.interp((np.arange(e) + 0.5) / e, cw[1:], u)
    for _ in range(iters):
        t = 0.5 * (lv[1:] + lv[:-1])
        # cell j holds grid points with u > t_{j-1} and u <= t_j (on a threshold: the lower level)
        idx = np.concatenate([[0], np.searchsorted(u, t, side="right"), [grid]])
        m = cw[idx[1:]] - cw[idx[:-1]]
        new = np.where(m > 0, (cwu[idx[1:]] - cwu[idx[:-1]]) / np.where(m > 0, m, 1.0), lv)
        new = 0.5 * (new - new[::-1])
        moved = np.abs(new - lv).max()
        lv = new
        if moved < 1e-14:
            break
    t = 0.5 * (lv[1:] + lv[:-1])
    idx = np.concatenate([[0], np.searchsorted(u, t, side="right"), [grid]])
    m = cw[idx[1:]] - cw[idx[:-1]]
    s1 = cwu[idx[1:]] - cwu[idx[:-1]]
    s2 = cwuu[idx[1:]] - cwuu[idx[:-1]]
    mse = float(np.sum(s2 - 2 * lv * s1 + lv * lv * m))
    _LEVELS_CACHE[key] = (lv, mse)
    return lv, mse


def rotated_quantize(y: torch.Tensor, levels: torch.Tensor, scale: str = "lsq") -> torch.Tensor:
    """Quantise-dequantise rows already in the rotated basis (f32, last dim d), as the contract:
    u = y * (1/‖y‖); code_c = #{i: u_c > τ_i}, τ_i = (ℓ_i + ℓ_{i+1})/2 in f32; γ = <y, ℓ̂>/<ℓ̂, ℓ̂>
    rounded to fp16; ŷ_c = γ ℓ_{code_c}. ‖y‖ = 0 -> codes E/2, γ = 0. ``scale="norm"`` (a
    variant outside the contract) keeps γ = fp16(‖y‖) instead of the least-squares scale."""
    lv = levels.to(torch.float32).to(y.device)
    e = lv.numel()
    tau = (lv[1:] + lv[:-1]) * 0.5
    nrm = y.norm(dim=-1, keepdim=True)
    zero = nrm == 0
    inv = 1.0 / torch.where(zero, torch.ones_like(nrm), nrm)
    u = y * inv
    code = torch.bucketize(u, tau, right=False)  # number of thresholds strictly below u
    code = torch.where(zero, torch.full_like(code, e // 2), code)
    lh = lv[code]
    if scale == "lsq":
        g = (y * lh).sum(-1, keepdim=True) / (lh * lh).sum(-1, keepdim=True)
    elif scale == "norm":
        g = nrm
    else:
        raise ValueError(scale)
    g = torch.where(zero, torch.zeros_like(g), g).to(torch.float16).to(torch.float32)
    return g * lh


def fp8_e4m3(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """FlashInfer / vLLM fp8 KV cache: x / scale cast per element to float8_e4m3fn, saturating
    at ±448 as their cache-write kernels do (__NV_SATFINITE), then back: fp8 * scale."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise SystemExit("sim:fp8 needs torch.float8_e4m3fn")
    y = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return y * scale


class TierSim:
    """Simulates one tier of a spec (keys and values) on [H, T, D] tensors of full pages."""

    def __init__(self, spec_path: Path, tier_name: str, sink: int | None = None, window: int | None = None):
        spec_path = Path(spec_path)
        if not spec_path.is_absolute() and not spec_path.exists():
            spec_path = ROOT / spec_path
        if not spec_path.is_file():  # eval.py records the scheme as skipped and goes on
            raise SystemExit(f"sim: no spec {spec_path}")
        spec = tomllib.loads(spec_path.read_text())
        tiers = {t["name"]: t for t in spec["tier"]}
        if tier_name not in tiers:
            raise SystemExit(f"{spec_path}: no tier `{tier_name}` (tiers: {list(tiers)})")
        self.tier = dict(tiers[tier_name])
        if sink is not None:
            self.tier["sink_tokens"] = sink
        if window is not None:
            self.tier["window_tokens"] = window
        self.page = int(spec.get("page", {}).get("tokens", 64))
        self.spec_name = spec["spec"]["name"]
        self.codebook = None
        # A spec with any rotated tier stores every tier (the fp16 tail too) in the rotated basis.
        rot = [t[p] for t in spec["tier"] for p in ("key", "value") if t[p]["scheme"] == "rotated"]
        spec_seed = next((spec[t]["seed"] for t in ("spec", "rotation", "geometry") if "seed" in spec.get(t, {})), ROT_DEFAULT_SEED)
        seeds = {int(c.get("seed", spec_seed)) for c in rot}
        if len(seeds) > 1:
            raise SystemExit(f"{spec_path}: rotated tiers with different seeds {sorted(seeds)}")
        self.rotated = bool(rot)
        self.seed = seeds.pop() if seeds else None
        # sim-only: the first sink_tokens tokens stay at the tail's precision (a variant)
        self.sink = int(self.tier.get("sink_tokens", 0))
        # sim-only: each query sees its window_tokens most recent keys/values at the tail's
        # precision too (KIVI's full-precision residual; see SimBackend.attend)
        self.window = int(self.tier.get("window_tokens", 0))
        if self.sink < 0 or self.window < 0:
            raise SystemExit(f"{spec_path}: tier `{tier_name}`: sink_tokens / window_tokens must be >= 0")
        self.all_tokens = self.tier["key"]["scheme"] == "fp8"  # FlashInfer's fp8 cache has no fp16 tail
        key = self.tier["key"]
        if key["scheme"] == "spherical":
            from safetensors.torch import load_file

            path = (spec_path.parent / key["codebook"]).resolve()
            self.codebook = load_file(str(path))["codebook"].float()
        for part in ("key", "value"):
            if self.tier[part]["scheme"] in ("drop",):
                raise SystemExit(f"sim: tier `{tier_name}` drops tokens; only storing tiers can be simulated")

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        """The tail page (and sink tokens) as stored: fp16 in the spec's basis (returned in the
        model's basis, f32); identity for unrotated specs (the model's own K/V dtype)."""
        if not self.rotated:
            return x
        return unrotate(rotate(x.float(), self.seed).to(torch.float16).float(), self.seed)

    def _rotated(self, x: torch.Tensor, s: dict) -> torch.Tensor:
        lv, _ = lloyd_max_levels(x.shape[-1], int(s["bits"]), s.get("levels", "beta"))
        levels = torch.tensor(int8_grid(lv) if int(s["bits"]) <= 3 else lv, dtype=torch.float64).to(torch.float32)
        if s.get("prescale") == "channel":  # sim-only variant: per-channel mean and RMS (f32, no bytes)
            x = x.float()
            mu_c = x.mean(-2, keepdim=True)
            sigma = (x - mu_c).pow(2).mean(-2, keepdim=True).sqrt().clamp_min(1e-6)
            y = rotate((x - mu_c) / sigma, self.seed)
            return unrotate(rotated_quantize(y, levels, s.get("scale", "lsq")), self.seed) * sigma + mu_c
        y = rotate(x.float(), self.seed)
        mu = 0.0
        if s.get("center") == "page":  # sim-only variant: fp16 per-page channel mean subtracted
            h, t, d = y.shape
            n = t // self.page * self.page
            m = y[:, :n].reshape(h, n // self.page, self.page, d).mean(2, keepdim=True).half().float()
            mu = torch.cat([m.expand(h, n // self.page, self.page, d).reshape(h, n, d), y[:, n:].mean(1, keepdim=True).half().float().expand(h, t - n, d)], dim=1)
        elif s.get("center") == "sequence":  # sim-only variant: one f32 mean per kv head (no bytes)
            mu = y.mean(1, keepdim=True)
        return unrotate(rotated_quantize(y - mu, levels, s.get("scale", "lsq")) + mu, self.seed)

    def _common(self, x: torch.Tensor, s: dict):
        if s["scheme"] in ("fp16", "bf16"):
            return self.tail(x)
        if s["scheme"] == "rotated":
            return self._rotated(x, s)
        if s["scheme"] == "fp8":
            return fp8_e4m3(x, float(s.get("scale", 1.0)))
        return None

    def keys(self, k: torch.Tensor, rscale=None) -> torch.Tensor:
        s = self.tier["key"]
        out = self._common(k, s)
        if out is not None:
            return out
        if s["scheme"] == "int":
            return quantize_int_keys(k, s["bits"], s.get("block", self.page), s.get("scale_dtype", "fp16"))
        if s["scheme"] == "spherical":
            return quantize_spherical_keys(k, s["group"], self.codebook.to(k.device), rscale)
        raise SystemExit(f"sim: key scheme {s['scheme']} not simulated")

    def values(self, v: torch.Tensor) -> torch.Tensor:
        s = self.tier["value"]
        out = self._common(v, s)
        if out is not None:
            return out
        if s["scheme"] == "int":
            return quantize_int_values(v, s["bits"], s["group"], s.get("scale_dtype", "fp16"))
        raise SystemExit(f"sim: value scheme {s['scheme']} not simulated")

    def payload_bytes_per_token(self, d: int) -> float:
        """Bytes per token per kv head of K + V payload and metadata (no page headers)."""
        return _part_bytes(self.tier["key"], d, self.page, True) + _part_bytes(self.tier["value"], d, self.page, False)

    def bytes_per_token_at(self, d: int, tokens: int) -> float:
        """Bytes per token per kv head of a ``tokens``-token cache when its sinks and its most
        recent window are fp16 (4·d each) and every other token is in the tier: the fp16 part
        amortised over the context (no page headers; the tail page is taken as inside the window)."""
        fp16 = min(tokens, self.sink + self.window)
        return (fp16 * 4.0 * d + (tokens - fp16) * self.payload_bytes_per_token(d)) / tokens


def _part_bytes(s: dict, d: int, page: int, is_key: bool) -> float:
    sb = 2 if s.get("scale_dtype", "fp16") == "fp16" else 4
    if s["scheme"] in ("fp16", "bf16"):
        return 2.0 * d
    if s["scheme"] == "drop":
        return 0.0
    if s["scheme"] == "rotated":
        return d * s["bits"] / 8 + 2 + (2 * d / page if s.get("center") == "page" else 0)  # codes, fp16 γ (, page mean)
    if s["scheme"] == "fp8":
        return 1.0 * d
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
# sim-only tiers (benches/quality/sim-tiers.toml): FlashInfer's fp8 KV cache and the rotated
# contract's tiers before specs/rotated.toml exists (same tier names: r4 / r3 / r2), plus
# variants outside the contract; `sim:specs/rotated.toml:r3` simulates the shipped spec.
SIM_TIERS = "benches/quality/sim-tiers.toml"


def _sim_tier_names(path: str = SIM_TIERS) -> list:
    """Every tier name of the sim-tiers spec (so a tier added there is simulated by name)."""
    with open(Path(__file__).resolve().parents[2] / path, "rb") as f:
        return [t["name"] for t in tomllib.load(f).get("tier", [])]


SIM_ALIASES.update({n: (SIM_TIERS, n) for n in _sim_tier_names()})


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


_SIM_SUFFIX = re.compile(r"(?P<base>.+?)(?:-sink(?P<sink>[0-9]+))?(?:-win(?P<window>[0-9]+))?")


def sim_target(rest: str) -> tuple[str, str, dict]:
    """(spec, tier, overrides) of a ``sim:`` backend name without its ``sim:``: a sim-tiers.toml
    name or alias (``r3-kcs``), else ``<spec.toml>:<tier>``. A name that is neither may end in
    ``-sink<N>`` and/or ``-win<W>`` (in that order) after one that is: the tier with
    ``sink_tokens = N`` / ``window_tokens = W`` set (``sim:r3-kcs-sink64-win128``,
    ``sim:specs/rotated.toml:r3-win64``), so every (tier, sinks, window) point of a screen
    needs no tier of its own in sim-tiers.toml."""
    if rest in SIM_ALIASES:
        return (*SIM_ALIASES[rest], {})
    m = _SIM_SUFFIX.fullmatch(rest)
    over = {}
    if m and (m["sink"] or m["window"]):
        rest = m["base"]
        over = {k: int(m[k]) for k in ("sink", "window") if m[k]}
    if rest in SIM_ALIASES:
        return (*SIM_ALIASES[rest], over)
    spec, _, tier = rest.rpartition(":")
    return spec, tier, over


class SimBackend:
    """Dequantised K/V of every full page (tail page fp16), then eager attention. ``sink`` /
    ``window`` override the tier's sim-only ``sink_tokens`` / ``window_tokens``."""

    measured_bytes = False

    def __init__(self, spec: str, tier: str, name: str, sink: int | None = None, window: int | None = None):
        self.name = name
        self.spec, self.tier_name = spec, tier
        self.sim = TierSim(Path(spec), tier, sink=sink, window=window)
        self.rscale = {}

    def reset(self):
        self.rscale = {}

    def attend(self, layer, q, k, v, scaling):
        """The stored cache (full pages in the tier, sinks and the tail page fp16) attended
        causally; with a window (``window_tokens`` W > 0) query i reads keys/values
        i-W+1..i at the tail's precision instead (``windowed_causal``)."""
        s = k.shape[1]
        full = s if self.sim.all_tokens else (s // self.sim.page) * self.sim.page
        if full == 0:
            if self.sim.rotated:
                k, v = self.sim.tail(k).to(k.dtype), self.sim.tail(v).to(v.dtype)
            return eager_causal(q, k, v, scaling)
        k0, v0 = k, v
        if self.sim.rotated:
            k = torch.cat([k[:, :full], self.sim.tail(k[:, full:]).to(k.dtype)], dim=1)
            v = torch.cat([v[:, :full], self.sim.tail(v[:, full:]).to(v.dtype)], dim=1)
        sink = min(self.sim.sink, full)
        if sink:
            kq, vq = self._quantised(layer, k[:, sink:], v[:, sink:], full - sink)
            kq = torch.cat([self.sim.tail(k[:, :sink]).to(k.dtype), kq], dim=1)
            vq = torch.cat([self.sim.tail(v[:, :sink]).to(v.dtype), vq], dim=1)
        else:
            kq, vq = self._quantised(layer, k, v, full)
        if self.sim.window:
            kr, vr = self.sim.tail(k0).to(k0.dtype), self.sim.tail(v0).to(v0.dtype)
            return windowed_causal(q, kq, vq, kr, vr, scaling, self.sim.window)
        return eager_causal(q, kq, vq, scaling)

    def _quantised(self, layer, k, v, full):
        """K/V with the first ``full`` tokens stored in the tier, the rest as given."""
        kf, vf = k[:, :full].float(), v[:, :full].float()
        rs = None
        if self.sim.tier["key"]["scheme"] == "spherical":
            if layer not in self.rscale:  # fixed from the first pages encoded, as kvforge-rt
                self.rscale[layer] = radius_scales(kf, self.sim.tier["key"]["group"])
            rs = self.rscale[layer]
        kq = torch.cat([self.sim.keys(kf, rs).to(k.dtype), k[:, full:]], dim=1)
        vq = torch.cat([self.sim.values(vf).to(v.dtype), v[:, full:]], dim=1)
        return kq, vq

    def bytes_per_token(self, d: int) -> float:
        return self.sim.payload_bytes_per_token(d)

    def bytes_per_token_at(self, d: int, tokens: int) -> float:
        return self.sim.bytes_per_token_at(d, tokens)

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


def rope_params(model) -> tuple[float, int]:
    """(rope_theta, rotated channels) of a Llama-family config (transformers 5 keeps them in
    ``rope_parameters``, older versions on the config); kvtc undoes this RoPE on keys."""
    c = model.config
    rp = getattr(c, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(c, "rope_theta", None))
    rtype = rp.get("rope_type", "default")
    if theta is None or rtype not in ("default", None):
        raise SystemExit(f"kvtc: RoPE {rtype!r} (theta {theta}) is not the plain rotate_half RoPE kvforge-kvtc implements")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    frac = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) or 1.0
    return float(theta), int(head_dim * frac)


class _CaptureAll(Fp16Backend):
    """Exact attention that keeps every layer's K and V ([Hkv, S, D])."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, layer, q, k, v, scaling):
        self.k[layer], self.v[layer] = k.detach(), v.detach()
        return super().attend(layer, q, k, v, scaling)


def kvforge_binary() -> str:
    """``$KVFORGE_BIN``, else ``.bin/kvforge`` (carried to the device), else target/release/kvforge."""
    for c in (os.environ.get("KVFORGE_BIN"), ROOT / ".bin" / "kvforge", ROOT / "target" / "release" / "kvforge"):
        if c and Path(c).is_file():
            return str(c)
    raise SystemExit("kvtc: no kvforge binary ($KVFORGE_BIN, .bin/kvforge or target/release/kvforge)")


def kvtc_roundtrip(k: dict, v: dict, cal: Path, ratio: float, entropy: str = "deflate", workdir: Path | None = None):
    """Packs layers' K/V ({layer: [Hkv, S, D]}, positions 0..S-1) with the kvforge binary and
    unpacks them: (restored k dict, restored v dict, pack statistics)."""
    import json
    import subprocess
    import tempfile

    from safetensors.torch import load_file, save_file

    layers = sorted(k)
    s = k[layers[0]].shape[1]
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        dump = {f"k.L{i:02d}": k[l].to("cpu", torch.float16).contiguous() for i, l in enumerate(layers)}
        dump |= {f"v.L{i:02d}": v[l].to("cpu", torch.float16).contiguous() for i, l in enumerate(layers)}
        dump["positions"] = torch.arange(s, dtype=torch.int64)
        save_file(dump, str(tmp / "in.safetensors"))
        exe = kvforge_binary()
        run = lambda *a: subprocess.run([exe, *map(str, a)], check=True, capture_output=True, text=True)  # noqa: E731
        try:
            run("pack", tmp / "in.safetensors", "--calibration", cal, "--ratio", ratio, "--entropy", entropy,
                "--out", tmp / "c.kvtc", "--json", tmp / "stats.json")
            run("unpack", tmp / "c.kvtc", "--calibration", cal, "--out", tmp / "out.safetensors")
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"kvtc: {' '.join(map(str, e.cmd))} failed ({e.returncode}): {e.stderr.strip()}") from e
        stats = json.loads((tmp / "stats.json").read_text())
        out = load_file(str(tmp / "out.safetensors"))
    dev = k[layers[0]].device
    rk = {l: out[f"k.L{i:02d}"].to(dev) for i, l in enumerate(layers)}
    rv = {l: out[f"v.L{i:02d}"].to(dev) for i, l in enumerate(layers)}
    return rk, rv, stats


class KvtcSimBackend:
    """kvtc as a storage codec (``sim:kvtc-<ratio>[-zstd|-none]``): ``prepare(model, ids)`` runs
    the input once with exact attention (the prefill that produces the cache), packs and unpacks
    every layer's K/V with the ``kvforge`` binary (sinks and the recent window stay fp16, as the
    calibration says), and the forward that follows attends over the restored cache for those
    positions (tokens generated after them are used as they come). Without ``prepare`` the
    backend refuses to run, so no result is silently fp16. ``$KVFORGE_KVTC_SIDES`` (``k`` or
    ``v``; default both) attends over the restored keys or values only and the exact other side:
    which side a ratio's loss comes from (bytes are still the whole container's)."""

    measured_bytes = True

    def __init__(self, ratio: float, entropy: str, name: str, tag: str = ""):
        self.name, self.ratio, self.entropy = name, ratio, entropy
        self.cal = Path(os.environ.get("KVFORGE_KVTC_CAL", str(DATA / "kvtc" / "calibration-emma.safetensors")))
        if tag:  # one point of a `kvforge calibrate` grid: <stem>-<tag><ext> beside $KVFORGE_KVTC_CAL
            self.cal = self.cal.with_name(f"{self.cal.stem}-{tag}{self.cal.suffix}")
        if not self.cal.is_file():
            raise SystemExit(f"{name}: no calibration {self.cal} (run `kvforge calibrate`, set $KVFORGE_KVTC_CAL)")
        self.rk = self.rv = None
        self.stats = None
        self.history = []
        self.sides = os.environ.get("KVFORGE_KVTC_SIDES", "kv")
        if self.sides not in ("k", "v", "kv"):
            raise SystemExit(f"{name}: $KVFORGE_KVTC_SIDES={self.sides!r}, expected k, v or kv")

    def reset(self):
        self.rk = self.rv = None

    def prepare(self, model, ids):
        global _BACKEND
        cap, prev = _CaptureAll(), _BACKEND
        _BACKEND = cap
        try:
            with torch.no_grad():
                dev = next(model.parameters()).device
                model(input_ids=torch.tensor([ids], device=dev), use_cache=False)
        finally:
            _BACKEND = prev
        self.rk, self.rv, self.stats = kvtc_roundtrip(cap.k, cap.v, self.cal, self.ratio, self.entropy)
        if "k" not in self.sides:
            self.rk = {l: cap.k[l] for l in cap.k}
        if "v" not in self.sides:
            self.rv = {l: cap.v[l] for l in cap.v}
        self.history.append(self.stats)

    def attend(self, layer, q, k, v, scaling):
        if self.rk is None:
            raise SystemExit(f"{self.name}: prepare(model, ids) was not called before the forward")
        rk, rv = self.rk[layer], self.rv[layer]
        n = rk.shape[1]
        if k.shape[1] < n:
            raise SystemExit(f"{self.name}: forward over {k.shape[1]} tokens, the prepared cache has {n}")
        k = torch.cat([rk.to(k.dtype), k[:, n:]], dim=1)
        v = torch.cat([rv.to(v.dtype), v[:, n:]], dim=1)
        return eager_causal(q, k, v, scaling)

    def bytes_per_token(self, d: int) -> float:
        if self.stats is None:
            return float("nan")
        return float(self.stats["bytes_per_token_per_kv_head"])

    def describe(self):
        return {"kind": "sim", "codec": "kvtc", "ratio": self.ratio, "entropy": self.entropy, "calibration": str(self.cal), "restored_sides": self.sides,
                "bytes_source": "measured: whole .kvtc container (fp16 sinks + window, positions, chunk headers) / (tokens x layers x kv heads)",
                "pack_stats": self.history}  # the list fills as the scheme runs (describe() comes first)


def prepare(model, ids) -> None:
    """Lets the current backend (or a compare backend's candidate) see the input before the
    forward: kvtc compresses the cache that an exact prefill of ``ids`` makes."""
    for b in (_BACKEND, getattr(_BACKEND, "cand", None), getattr(_BACKEND, "ref", None)):
        if hasattr(b, "prepare"):
            b.prepare(model, ids)


def make_backend(name: str, max_tokens: int = 8192 + 256):
    if name == "fp16":
        return Fp16Backend()
    kind, _, rest = name.partition(":")
    if kind == "sim" and rest.startswith("kvtc-"):
        spec, _, tag = rest.partition("@")
        parts = spec.split("-")
        entropy = parts[2] if len(parts) > 2 else "deflate"
        if len(parts) > 3 or entropy not in ("deflate", "zstd", "rans", "none") or not re.fullmatch(r"[0-9.]+", parts[1]) or not re.fullmatch(r"[A-Za-z0-9._-]*", tag):
            raise SystemExit(f"unknown kvtc backend `{name}`: sim:kvtc-<ratio>[-deflate|-zstd|-rans|-none][@<grid tag, e.g. ks0.3-dp64>]")
        return KvtcSimBackend(float(parts[1]), entropy, name, tag)
    if kind == "sim" and rest.startswith("paris-"):
        import paris_sim  # ParisKV retrieval (seed 001): sim:paris-k<k>[-oracle]...

        return paris_sim.ParisSimBackend.parse(name)
    if kind == "sim" and rest.startswith("sph:"):
        return SphSimBackend(rest[4:], name)
    if kind == "sim":
        spec, tier, over = sim_target(rest)
        return SimBackend(spec, tier, name, **over)
    if kind == "kvforge":
        spec, _, tier = rest.rpartition(":")
        if rest in SIM_ALIASES:
            spec, tier = SIM_ALIASES[rest]
        return KvforgeBackend(spec, tier, name, max_tokens)
    raise SystemExit(f"unknown backend `{name}`: fp16 | sim:int8|int4|int2 | sim:<spec>:<tier> | kvforge:<spec>:<tier>")


def log(*a):
    print(*a, file=sys.stderr, flush=True)
