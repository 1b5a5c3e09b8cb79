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
    g = torch.Generator().manual_seed(2)
    k = torch.randn(3, 140, 64, generator=g)
    v = torch.randn(3, 140, 64, generator=g)
    q = torch.randn(9, 140, 64, generator=g)
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
