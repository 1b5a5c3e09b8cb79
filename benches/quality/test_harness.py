"""CPU tests of the harness pieces that need no model: quantisers against kvforge-ref's
formulas, the causal reference against torch SDPA, and the kvforge backend's bookkeeping
(prefill via attend_prefix, one-token decode, incremental appends) against the simulation,
through a fake ``kvforge`` module that implements the planned API in torch.

    .venv-torch/bin/python -m pytest -q benches/quality/test_harness.py
"""

import math
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvq  # noqa: E402


def _kvq(seed: int, n: int):
    """Keys and values of 3 kv heads and queries of 9 heads (GQA 3), `n` tokens, d 64, drawn in
    that order from one generator seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(h, n, 64, generator=g) for h in (3, 3, 9))


def test_eager_causal_matches_sdpa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 70, 64, generator=g)
    k = torch.randn(3, 100, 64, generator=g)
    v = torch.randn(3, 100, 64, generator=g)
    out = kvq.eager_causal(q, k, v, 0.125)  # queries are the last 70 of 100 positions
    ks, vs = k.repeat_interleave(3, 0), v.repeat_interleave(3, 0)
    mask = torch.ones(70, 100, dtype=torch.bool).tril(diagonal=30)
    ref = torch.nn.functional.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=0.125)
    assert torch.allclose(out, ref.transpose(0, 1), atol=1e-5)


def test_int_quantize_matches_formula():
    x = torch.tensor([[0.0, 0.1, 0.5, 1.0, -0.3]])
    y = kvq.int_quantize(x, 2, 1, "fp32")
    mn, mx = -0.3, 1.0
    scale = (mx - mn) / 3
    want = [min(3, max(0, math.floor((v - mn) / scale + 0.5))) * scale + mn for v in x[0].tolist()]
    assert torch.allclose(y[0], torch.tensor(want), atol=1e-6)
    const = kvq.int_quantize(torch.full((1, 4), 2.5), 4, 1, "fp16")  # scale 0: code 0, x = zero
    assert torch.equal(const, torch.full((1, 4), 2.5))


def test_int_error_within_half_step():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(3, 128, 64, generator=g)
    for bits in (8, 4, 2):
        kq = kvq.quantize_int_keys(k, bits, 64, "fp32")
        step = (k.reshape(3, 2, 64, 64).amax(2) - k.reshape(3, 2, 64, 64).amin(2)) / (2**bits - 1)
        err = (kq - k).abs().reshape(3, 2, 64, 64)
        assert (err <= step[:, :, None, :] / 2 + 1e-5).all()
        v = kvq.quantize_int_values(k, bits, 32, "fp32")
        assert v.shape == k.shape


def test_spherical_exact_on_codewords():
    cb = torch.eye(16)  # codewords e_0..e_15
    k = torch.zeros(1, 4, 64)
    for t in range(4):
        for j in range(4):
            k[0, t, j * 16 + (t + j) % 16] = 1.0 + t
    rs = kvq.radius_scales(k, 16, headroom=1.0)
    kq = kvq.quantize_spherical_keys(k, 16, cb, rs)
    # directions are exact; radii are off by at most half a radius step
    assert torch.equal(kq != 0, k != 0)
    assert ((kq - k).abs() <= rs.max() / 2 + 1e-6).all()


def test_payload_bytes_match_spec_docs():
    d = 64
    cert = kvq.TierSim(kvq.ROOT / "specs/certified.toml", "q8k4v")
    # seed 004: 288 B at d = 128 -> int8 K (d) + fp32 scale/zero over B=16 + int4 V (d/2) + fp16 pairs per g=16
    assert kvq.TierSim(kvq.ROOT / "specs/certified.toml", "q8k4v").payload_bytes_per_token(128) == pytest.approx(288)
    assert cert.payload_bytes_per_token(d) == pytest.approx(64 + 32 + 32 + 16)
    high = kvq.TierSim(kvq.ROOT / "specs/spherical.toml", "high")
    assert high.payload_bytes_per_token(128) == pytest.approx(14 + 256)  # Table B.1 keys + fp16 values
    low = kvq.TierSim(kvq.ROOT / "specs/spherical.toml", "low")
    assert low.payload_bytes_per_token(128) == pytest.approx(6 + 256)


class _FakeCache:
    """The planned kvforge.Cache API over torch, with sim semantics (full pages in the tier)."""

    def __init__(self, spec, head_dim, num_kv_heads, gqa, max_tokens, target, root=None, **kw):
        self.sim = kvq.TierSim(Path(spec), target)
        self.k = torch.zeros(num_kv_heads, 0, head_dim)
        self.v = torch.zeros(num_kv_heads, 0, head_dim)
        self.rs = None
        self.calls = []
        self.num_kv_heads = num_kv_heads

    def seq_len(self, seq):
        return self.k.shape[1]

    def memory_report(self):
        return [{"resident_bytes": self.bytes_per_token() * self.k.shape[1] * self.num_kv_heads}]

    def add_sequence(self):
        return 0

    def append(self, seq, k, v):
        assert k.is_contiguous() and k.dim() == 3
        self.k = torch.cat([self.k, k.transpose(0, 1)], 1)
        self.v = torch.cat([self.v, v.transpose(0, 1)], 1)

    def _kv(self):
        full = self.k.shape[1] // 64 * 64
        ks, vs = self.k.clone(), self.v.clone()
        if full:
            if self.sim.tier["key"]["scheme"] == "spherical" and self.rs is None:
                self.rs = kvq.radius_scales(self.k[:, :full], self.sim.tier["key"]["group"])
            ks[:, :full] = self.sim.keys(self.k[:, :full], self.rs)
            vs[:, :full] = self.sim.values(self.v[:, :full])
        return ks, vs

    def attend_prefix(self, seq, q, lengths):
        self.calls.append(("prefix", len(lengths)))
        return self._attend(q, lengths)

    def _attend(self, q, lengths):
        ks, vs = self._kv()
        g = q.shape[1] // ks.shape[0]
        out = torch.empty_like(q)
        for i, n in enumerate(lengths):
            w = torch.einsum("hd,htd->ht", q[i], ks[:, :n].repeat_interleave(g, 0)) / math.sqrt(q.shape[2])
            out[i] = torch.einsum("ht,htd->hd", w.softmax(-1), vs[:, :n].repeat_interleave(g, 0))
        return out, None

    def decode(self, q, seqs):
        self.calls.append(("decode", 1))
        return self._attend(q, [self.k.shape[1]])[0], None

    def bytes_per_token(self):
        return self.sim.payload_bytes_per_token(self.k.shape[2])


@pytest.mark.parametrize("spec,tier", [("specs/rdkv.toml", "b4"), ("specs/certified.toml", "q8k4v"), ("specs/spherical.toml", "mid")])
def test_kvforge_backend_bookkeeping(monkeypatch, spec, tier):
    fake = types.ModuleType("kvforge")
    fake.Cache = _FakeCache
    monkeypatch.setitem(sys.modules, "kvforge", fake)
    be = kvq.make_backend(f"kvforge:{spec}:{tier}")
    sim = kvq.make_backend(f"sim:{spec}:{tier}")
    k, v, q = _kvq(2, 140)
    be.reset()
    sim.reset()
    # prefill of 130 tokens, then two one-token decode steps (as generate() calls it)
    o1 = be.attend(0, q[:, :130], k[:, :130], v[:, :130], 0.125)
    r1 = sim.attend(0, q[:, :130], k[:, :130], v[:, :130], 0.125)
    assert torch.allclose(o1, r1, atol=1e-4)
    for s in (131, 132):
        o = be.attend(0, q[:, s - 1:s], k[:, :s], v[:, :s], 0.125)
        r = sim.attend(0, q[:, s - 1:s], k[:, :s], v[:, :s], 0.125)
        assert torch.allclose(o, r, atol=1e-4)
    cache = be.layers[0]["cache"]
    assert cache.calls == [("prefix", 130), ("decode", 1), ("decode", 1)]
    assert cache.k.shape[1] == 132  # appended once each, no duplicates
    be.reset()
    assert be.layers == {}


# ---------------------------------------------------------------------------------------------
# Rotated tiers (issue 26 contract) and the fp8 e4m3 peer

def test_rotation_signs_bit_exact():
    # h of channels 0..3 under the default seed 0x5EED, and the negative-sign bitmask
    # (bit c set <=> s_c = -1): the values kvforge-spec's and the device header's tests pin too.
    assert kvq.rotation_signs(4, 0x5EED) == [1, 1, 1, 1]
    neg64 = sum(1 << c for c, s in enumerate(kvq.rotation_signs(64)) if s < 0)
    neg128 = sum(1 << c for c, s in enumerate(kvq.rotation_signs(128)) if s < 0)
    assert neg64 == 0xEA24301592AA8460
    assert neg128 == 0x2AA8039FBA6E052FEA24301592AA8460
    assert kvq.rotation_signs(128)[:64] == kvq.rotation_signs(64)  # a channel's sign does not depend on d
    # seed 0: h(0) = 0 (sign +); h(1) = 0x514E28B7 (odd: sign -)
    assert kvq.rotation_signs(2, 0) == [1, -1]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotation_orthogonal(d):
    eye = torch.eye(d, dtype=torch.float64)
    h = kvq.fwht(eye)  # Sylvester: H[i, j] = (-1)^popcount(i & j)
    pop = torch.tensor([bin(a & b).count("1") for a in range(d) for b in range(d)]).reshape(d, d)
    assert torch.equal(h, (1 - 2 * (pop % 2)).double())
    r = kvq.rotate(eye)  # row c = R e_c = column c of R
    assert torch.allclose(r @ r.T, eye, atol=1e-12)
    x = torch.randn(5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    assert torch.allclose(kvq.unrotate(kvq.rotate(x)), x, atol=1e-12)
    q, k = x[0], x[1]
    assert torch.allclose(kvq.rotate(q) @ kvq.rotate(k), q @ k, atol=1e-10)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_lloyd_max_levels(d, bits):
    import numpy as np

    lv, mse = kvq.lloyd_max_levels(d, bits)
    assert lv.shape == (1 << bits,)
    assert np.all(np.diff(lv) > 0) and -1 < lv[0] and lv[-1] < 1
    assert np.array_equal(lv, -lv[::-1])
    # d x distortion approaches the Gaussian Lloyd-Max distortion of N(0, 1) as d grows
    gauss = {2: 0.11748, 3: 0.03454, 4: 0.009497}[bits]
    assert d * mse == pytest.approx(gauss, rel=0.04 if d == 64 else 0.02)
    assert d * mse < gauss  # the Beta density has lighter tails than its Gaussian limit
    g, gm = kvq.lloyd_max_levels(d, bits, density="gaussian")
    assert d * gm == pytest.approx(gauss, rel=2e-3)
    # lighter tails than the Gaussian limit: the outer levels sit inside the Gaussian ones
    assert abs(lv[-1]) < abs(g[-1])


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_int8_grid_levels(d, bits):
    # kvforge-spec's grid at d 128: 3 bits 2^-9 · (±11, ±34, ±60, ±96), 2 bits 2^-9 · (±20, ±68)
    import numpy as np

    lv, _ = kvq.lloyd_max_levels(d, bits)
    g = kvq.int8_grid(lv)
    ints = None
    for k in range(16):
        n = g * 2.0**k
        if np.all(n == np.round(n)) and 64 <= abs(n[-1]) <= 127:
            ints = n
            break
    assert ints is not None, g
    assert np.all(np.abs(g - lv) <= 0.5 * 2.0**-k)
    if d == 128:
        want = {3: [11, 34, 60, 96], 2: [20, 68]}[bits]
        assert list(ints[len(ints) // 2 :]) == want


def test_rotated_codes_thresholds():
    lv = torch.tensor([-0.3, -0.1, 0.1, 0.3])
    # u exactly on a threshold takes the lower level; γ is the least-squares scale
    y = torch.tensor([[0.0, 0.6, -0.8, 0.0]])  # unit norm already: u = y
    out = kvq.rotated_quantize(y, lv)
    codes = torch.tensor([1, 3, 0, 1])  # 0.0 == τ_1 -> code 1
    lh = lv[codes]
    g = float((y[0] * lh).sum() / (lh * lh).sum())
    g16 = float(torch.tensor(g).half().float())
    assert torch.allclose(out[0], g16 * lh)
    zero = kvq.rotated_quantize(torch.zeros(1, 4), lv)
    assert torch.equal(zero, torch.zeros(1, 4))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotated_round_trip_error(bits):
    # rows of uniform random directions (any norm): relative squared error ≈ d x Lloyd-Max
    # distortion, a little below it (γ is the least-squares scale, not ‖x‖)
    d = 64
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4096, d, generator=g) * 7.0
    lv, mse = kvq.lloyd_max_levels(d, bits)
    y = kvq.rotate(x)
    yq = kvq.rotated_quantize(y, torch.tensor(lv, dtype=torch.float32))
    rel = ((yq - y).pow(2).sum(-1) / y.pow(2).sum(-1)).mean().item()
    assert 0.85 * d * mse < rel <= 1.01 * d * mse
    norm_scale = kvq.rotated_quantize(y, torch.tensor(lv, dtype=torch.float32), scale="norm")
    rel_norm = ((norm_scale - y).pow(2).sum(-1) / y.pow(2).sum(-1)).mean().item()
    assert rel <= rel_norm


def test_fp8_e4m3():
    x = torch.tensor([0.0, 1.0, -1.5, 448.0, 1000.0, -1000.0, 0.1])
    y = kvq.fp8_e4m3(x)
    assert y[:4].tolist() == [0.0, 1.0, -1.5, 448.0]
    assert y[4].item() == 448.0 and y[5].item() == -448.0  # saturating, not NaN
    assert abs(y[6].item() - 0.1) <= 0.1 * 2**-4
    assert kvq.TierSim(kvq.ROOT / kvq.SIM_TIERS, "fp8").payload_bytes_per_token(64) == 128


@pytest.mark.parametrize("tier", ["r4", "r3", "r2", "k3v2", "r2-sink64", "fp8"])
def test_sim_rotated_backend(tier):
    be = kvq.make_backend(f"sim:{tier}")
    k, v, q = _kvq(3, 150)
    be.reset()
    out = be.attend(0, q, k, v, 0.125)
    ref = kvq.eager_causal(q, k, v, 0.125)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < {"r4": 0.15, "r3": 0.25, "r2": 0.5, "k3v2": 0.5, "r2-sink64": 0.5, "fp8": 0.05}[tier]
    # the tail page (tokens 128..149) is fp16 in the rotated basis
    sim = be.sim
    if sim.rotated:
        t = sim.tail(k[:, 128:])
        assert (t - k[:, 128:]).abs().max().item() < 4e-3
    if tier == "r3":
        assert sim.payload_bytes_per_token(64) == 2 * (24 + 2)


def test_sim_key_centring_variant():
    # keys = a per-page constant row + small noise: centring removes the constant before coding,
    # so the error is that of the noise (plus the fp16 mean), far below the plain 3-bit error
    g = torch.Generator().manual_seed(4)
    base = torch.randn(3, 2, 1, 64, generator=g) * 10
    k = (base.expand(3, 2, 64, 64) + 0.1 * torch.randn(3, 2, 64, 64, generator=g)).reshape(3, 128, 64)
    plain = kvq.TierSim(kvq.ROOT / kvq.SIM_TIERS, "r3").keys(k)
    cent = kvq.TierSim(kvq.ROOT / kvq.SIM_TIERS, "r3-kc-sink64").keys(k)
    err = lambda x: ((x - k).norm() / k.norm()).item()
    assert err(cent) < 0.1 * err(plain)
    assert kvq.TierSim(kvq.ROOT / kvq.SIM_TIERS, "r3-kc-sink64").payload_bytes_per_token(64) == 24 + 2 + 2 + 24 + 2


def test_kvtc_grid_tag_picks_the_grid_file(tmp_path, monkeypatch):
    base = tmp_path / "cal.safetensors"
    base.write_bytes(b"x")
    (tmp_path / "cal-ks0.35-dp256.safetensors").write_bytes(b"x")
    monkeypatch.setenv("KVFORGE_KVTC_CAL", str(base))
    assert kvq.make_backend("sim:kvtc-16").cal == base
    b = kvq.make_backend("sim:kvtc-16@ks0.35-dp256")
    assert (b.cal, b.ratio, b.entropy) == (tmp_path / "cal-ks0.35-dp256.safetensors", 16.0, "deflate")
    assert kvq.make_backend("sim:kvtc-20-zstd@ks0.35-dp256").entropy == "zstd"
    with pytest.raises(SystemExit, match="no calibration"):
        kvq.make_backend("sim:kvtc-16@ks0.4-dp256")
    with pytest.raises(SystemExit, match="unknown kvtc backend"):
        kvq.make_backend("sim:kvtc-16@../x")


# ---------------------------------------------------------------------------------------------
# Recent window at fp16 (sim-only `window_tokens`, `-win<W>` names)

def _windowed_reference(q, kq, vq, kr, vr, scaling, window):
    """One query at a time: its cache is kq/vq up to i - window and kr/vr after (causal)."""
    hq, tq, _ = q.shape
    s = kq.shape[1]
    g = hq // kq.shape[0]
    out = torch.empty(tq, hq, q.shape[2], dtype=q.dtype)
    for t in range(tq):
        i = s - tq + t
        recent = torch.arange(i + 1) > i - window
        k = torch.where(recent[None, :, None], kr[:, : i + 1], kq[:, : i + 1]).repeat_interleave(g, 0)
        v = torch.where(recent[None, :, None], vr[:, : i + 1], vq[:, : i + 1]).repeat_interleave(g, 0)
        w = torch.einsum("hd,htd->ht", q[:, t], k) * scaling
        out[t] = torch.einsum("ht,htd->hd", w.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [1, 5, 64, 500])
def test_windowed_causal_matches_per_query_reference(window):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 40, 16, generator=g, dtype=torch.float64)
    kq, vq, kr, vr = (torch.randn(2, 90, 16, generator=g, dtype=torch.float64) for _ in range(4))
    out = kvq.windowed_causal(q, kq, vq, kr, vr, 0.25, window)  # queries: the last 40 of 90
    assert torch.allclose(out, _windowed_reference(q, kq, vq, kr, vr, 0.25, window), atol=1e-6)  # f32 softmax
    if window >= 90:  # every visible key is recent: plain causal attention over kr / vr
        assert torch.allclose(out, kvq.eager_causal(q, kr, vr, 0.25), atol=1e-12)
    same = kvq.windowed_causal(q, kq, vq, kq, vq, 0.25, window)
    assert torch.allclose(same, kvq.eager_causal(q, kq, vq, 0.25), atol=1e-12)


def test_sim_window_names_and_bytes():
    assert kvq.sim_target("r3-kcs") == (kvq.SIM_TIERS, "r3-kcs", {})
    assert kvq.sim_target("r3-kcs-sink64-win128") == (kvq.SIM_TIERS, "r3-kcs-sink64-win128", {})  # a tier of its own
    assert kvq.sim_target("r2-kcs-sink64-win256") == (kvq.SIM_TIERS, "r2-kcs", {"sink": 64, "window": 256})
    assert kvq.sim_target("r3-kc-sink64-win64") == (kvq.SIM_TIERS, "r3-kc", {"sink": 64, "window": 64})
    assert kvq.sim_target("int4-win128") == ("specs/rdkv.toml", "b4", {"window": 128})
    assert kvq.sim_target("specs/rotated.toml:r3-win64") == ("specs/rotated.toml", "r3", {"window": 64})
    be = kvq.make_backend("sim:r3-kcs-sink64-win128")
    alias = kvq.make_backend("sim:r3-kcs-win128")
    assert (be.sim.sink, be.sim.window, alias.sim.sink, alias.sim.window) == (64, 128, 0, 128)
    p = be.sim.payload_bytes_per_token(64)  # 24 + 2 per side
    assert p == 52
    assert be.bytes_per_token_at(64, 2048) == pytest.approx((192 * 256 + (2048 - 192) * p) / 2048)
    assert be.bytes_per_token_at(64, 100) == 256
    assert kvq.make_backend("sim:r3").bytes_per_token_at(64, 2048) == p


def test_sim_window_prompt_matches_decode():
    # the prompt's query i sees what a one-token decode step at position i sees (per-token codes:
    # a token's code does not depend on the tokens after it, so the two caches agree on it)
    be = kvq.make_backend("sim:r3-sink64-win100")
    k, v, q = _kvq(6, 200)
    be.reset()
    full = be.attend(0, q, k, v, 0.125)
    for i in (170, 199):  # sinks 0..63 fp16, keys 64..i-100 in the tier, i-99..i fp16
        step = be.attend(0, q[:, i:i + 1], k[:, : i + 1], v[:, : i + 1], 0.125)
        assert torch.allclose(step[0], full[i], atol=1e-5)
    # the window helps: closer to exact attention than the same tiers without it
    ref = kvq.eager_causal(q, k, v, 0.125)
    err = lambda o: ((o - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(full) < err(kvq.make_backend("sim:r3-sink64").attend(0, q, k, v, 0.125))
    kcs = kvq.make_backend("sim:r3-kcs-sink64-win128")
    assert err(kcs.attend(0, q, k, v, 0.125)) < err(kvq.make_backend("sim:r3-kcs-sink64").attend(0, q, k, v, 0.125))
