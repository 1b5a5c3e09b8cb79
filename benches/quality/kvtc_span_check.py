#!/usr/bin/env python3
"""Share of K/V norm outside a kvtc calibration basis, for tokens sampled by the PCA (4..T-128)
and for the recent window never sampled (T-128..T) of the same capture (one window).

    python3 benches/quality/kvtc_span_check.py data/keys/kv-emma-per-layer.safetensors cal.safetensors
"""
import sys

import numpy as np
from safetensors.numpy import load_file
d = load_file(sys.argv[1]); c = load_file(sys.argv[2])
T = d["k.L00"].shape[1]; D = d["k.L00"].shape[2]; half = D // 2; inv = 1e5 ** (-2*np.arange(half)/D)  # SmolLM2 rope_theta
for side in "kv":
    X = np.stack([d[f"{side}.L{l:02d}"].astype(np.float64) for l in range(sum(k.startswith("k.L") for k in d))])  # L,H,T,D
    X = X.transpose(2,0,1,3)  # T,L,H,D
    if side == "k":
        t = np.arange(T)[:,None]*inv; cc, ss = np.cos(t)[:,None,None,:], np.sin(t)[:,None,None,:]
        a, b = X[...,:half].copy(), X[...,half:].copy()
        X[...,:half] = a*cc + b*ss; X[...,half:] = b*cc - a*ss
    X = X.reshape(T, -1)
    mu = c[f"{side}.mean"].astype(np.float64); B = c[f"{side}.basis"].astype(np.float64)
    for name, rows in (("in-sample 4..T-128", slice(4, T - 128)), ("held-out last 128", slice(T - 128, T))):
        Y = X[rows] - mu
        r = Y - (Y @ B.T) @ B
        print(side, name, "residual outside the basis (rel):", np.linalg.norm(r)/np.linalg.norm(X[rows]), " centred energy share:", (np.linalg.norm(r)/np.linalg.norm(Y))**2)
