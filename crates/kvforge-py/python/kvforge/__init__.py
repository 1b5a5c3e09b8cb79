"""kvforge: compressed-KV-cache decode attention on NVIDIA GPUs, on PyTorch tensors.

A spec TOML (``specs/*.toml`` of the kvforge repository) says how tokens may be stored
(fp16, per-channel/per-token integer codes, Spherical-KV angle codes, dropped); kvforge
compiles matching CUDA kernels with NVRTC on first use and keeps a paged, tiered cache on the
GPU. Tensors are torch CUDA tensors in the spec dtype, used in place (no copies of queries or
outputs)::

    import torch, kvforge
    cache = kvforge.Cache("specs/rdkv.toml", head_dim=64, num_kv_heads=3, gqa=3, max_tokens=8192, target="b4")
    seq = cache.add_sequence()
    cache.append(seq, k, v)                      # k, v: [T, 3, 64] fp16 on cuda
    out, lse = cache.attend_prefix(seq, q)       # q: [T, 9, 64]: causal attention of the prompt
    out, lse = cache.decode(q_next, seqs=[seq])  # q_next: [1, 9, 64]: one decode step

Relative spec paths are also looked up under ``root=`` and ``$KVFORGE_ROOT``. Compiled
kernels are cached under ``$KVFORGE_CACHE_DIR`` (default ``~/.cache/kvforge``); NVRTC
(``libnvrtc.so``) and libcuda must be loadable (``LD_LIBRARY_PATH=/usr/local/cuda/lib64``).
Every failure raises :class:`KvforgeError`.

Tier controllers and certified decode::

    ctl = kvforge.Controller(cache, policy="rdr", budget=48.0)  # bytes / token / kv head
    report = ctl.apply(cache, seq, token_mass=mass)             # mass: [kv heads, seq_len]
    report.dropped, report.bytes_after, report.duality_gap      # controller telemetry
    out, lse = cache.decode(q_next, seqs=[seq], track=ctl.tracks())  # RDR's page importance on the GPU (1 step in 8)
    if ctl.due():                                               # every `every` decode steps
        ctl.apply(cache, seq, window=True)                      # rolls the GPU window into the EMA
    cache.keep_originals()                                      # before appending: fp16 tier 2
    out, lse, heads = kvforge.Certifier().decode(cache, q_next, [seq])
    heads[0].bound, heads[0].rung                               # per-head certificate

Logs: ``KVFORGE_LOG=debug`` (any ``tracing`` filter, e.g. ``kvforge_rt::jit=debug``) set
before ``import kvforge`` prints decode plans, kernel compiles (cache hit or miss, NVRTC time)
and launches on stderr; ``kvforge.enable_logs("debug")`` does the same at run time.

:mod:`kvforge.hf` runs a transformers model's attention on these caches
(``kvforge.hf.use_kvforge(model, spec, tier)``); it imports torch and transformers only when used.
:mod:`kvforge.retrieval` decodes with ParisKV retrieval instead (``use_retrieval(model, k=256)``:
sinks + local window + the top-k keys retrieved on the GPU, the rest's K/V in pinned host memory).
"""

from ._errors import KvforgeError
from ._native import (
    Cache,
    Certifier,
    Codebooks,
    ControlReport,
    Controller,
    HeadCertificate,
    KvtcCalibration,
    ParisIndex,
    Plan,
    RetrievalCache,
    __version__,
    check_tensor,
    device_info,
    empty_cache,
    kvtc_load,
    kvtc_save,
    enable_logs,
    driver_present,
    nvrtc_present,
    spec_page_tokens,
)
from . import hf, retrieval

__all__ = [
    "Cache",
    "Certifier",
    "Codebooks",
    "ControlReport",
    "Controller",
    "HeadCertificate",
    "KvforgeError",
    "KvtcCalibration",
    "ParisIndex",
    "Plan",
    "RetrievalCache",
    "__version__",
    "check_tensor",
    "device_info",
    "empty_cache",
    "enable_logs",
    "hf",
    "kvtc_load",
    "kvtc_save",
    "driver_present",
    "nvrtc_present",
    "retrieval",
    "spec_page_tokens",
]


def _cache_save(self, seq, path, calibration, ratio=16.0, entropy="deflate", chunk_tokens=256):
    """Saves sequence ``seq`` of this cache as a kvtc container (a one-layer calibration; a
    model's caches, one per layer: :func:`kvtc_save`). Returns the sizes."""
    return kvtc_save([self], seq, path, calibration, ratio=ratio, entropy=entropy, chunk_tokens=chunk_tokens)


def _cache_load(self, path, calibration, tier=None):
    """Restores a kvtc container on the GPU into a new sequence of this cache (full pages in
    ``tier``; one-layer calibration; several layers: :func:`kvtc_load`). Returns its id."""
    return kvtc_load([self], path, calibration, tier=tier)[0]


Cache.save = _cache_save
Cache.load = _cache_load


def _logs_from_env():
    import os
    import warnings

    filt = os.environ.get("KVFORGE_LOG", "").strip()
    if filt:
        try:
            enable_logs(filt)
        except KvforgeError as e:
            warnings.warn(f"KVFORGE_LOG ignored: {e}", stacklevel=3)


_logs_from_env()
