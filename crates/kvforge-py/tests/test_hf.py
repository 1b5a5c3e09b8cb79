"""CPU tests of kvforge.hf, the transformers integration, without a GPU: a fake ``kvforge``
module whose ``Cache`` implements the API in torch (exact attention) stands in for the
extension, and a tiny random Llama runs a forward with labels and ``generate`` on it, against
transformers' eager attention. The tests that need torch/transformers skip where those are
missing (CI); the import test runs everywhere.

    .venv-torch/bin/python -m pytest -q crates/kvforge-py/tests/test_hf.py
"""

import importlib.util
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

HF_SOURCE = Path(__file__).resolve().parents[1] / "python" / "kvforge" / "hf.py"


def _load_hf():
    spec = importlib.util.spec_from_file_location("kvforge_hf_under_test", HF_SOURCE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, check=False)


def test_hf_imports_without_torch_or_transformers():
    code = (
        "import importlib.util, sys\n"
        f"s = importlib.util.spec_from_file_location('h', {str(HF_SOURCE)!r})\n"
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
        "assert callable(m.use_kvforge) and m.ATTN_NAME == 'kvforge'\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr


def test_package_import_kvforge_hf_is_lazy():
    try:
        import kvforge  # noqa: F401  (the built package: ci.sh puts it on PYTHONPATH)
    except ImportError:
        pytest.skip("kvforge extension not importable here (ci.sh builds it)")
    r = _run("import sys, kvforge, kvforge.hf\n"
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
             "assert kvforge.hf.KvforgeAttention and kvforge.hf.use_kvforge\n")
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------------
# With torch: a fake extension

class _FakeCache:
    """kvforge.Cache's API over torch tensors: exact attention (as the fp16 tier stores), one
    (k, v) pair [Hkv, T, D] per sequence; removed ids are reused, as the real cache does."""

    made = []

    def __init__(self, spec, head_dim, num_kv_heads, gqa, max_tokens, target=None, root=None, device=0, **kw):
        import torch

        self.torch = torch
        self.args = dict(spec=spec, head_dim=head_dim, num_kv_heads=num_kv_heads, gqa=gqa, max_tokens=max_tokens,
                         target=target, root=root, device=device)
        self.kw = kw
        self.kv = {}
        self.calls = []
        _FakeCache.made.append(self)

    @property
    def k(self):  # sequence 0's keys (None while empty)
        return self.kv.get(0, (None, None))[0]

    def add_sequence(self):
        i = next(i for i in range(len(self.kv) + 1) if i not in self.kv)
        self.kv[i] = (None, None)
        return i

    def remove_sequence(self, seq):
        del self.kv[seq]
        self.calls.append(("remove", seq))

    def _put(self, seq, k, v):
        a = self.args
        assert k.is_contiguous() and v.is_contiguous()
        assert k.dim() == 3 and k.shape[1:] == (a["num_kv_heads"], a["head_dim"]) and v.shape == k.shape
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        k0, v0 = self.kv[seq]
        self.kv[seq] = (k.clone() if k0 is None else self.torch.cat([k0, k], 1), v.clone() if v0 is None else self.torch.cat([v0, v], 1))
        assert sum(self.seq_len(s) for s in self.kv) <= a["max_tokens"]

    def append(self, seq, k, v):
        self._put(seq, k, v)
        self.calls.append(("append", k.shape[0]))

    def append_device(self, seq, k, v):
        self._put(seq, k, v)
        self.calls.append(("append_device", k.shape[0]))

    def append_step(self, seqs, k, v):
        assert k.shape[0] == len(seqs) == len(set(seqs))
        for i, seq in enumerate(seqs):
            self._put(seq, k[i:i + 1].contiguous(), v[i:i + 1].contiguous())
        self.calls.append(("append_step", len(seqs)))

    def _attend(self, q, seqs, lengths):
        torch = self.torch
        a = self.args
        assert q.is_contiguous() and q.shape[1:] == (a["num_kv_heads"] * a["gqa"], a["head_dim"])
        g = a["gqa"]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for i, (seq, n) in enumerate(zip(seqs, lengths)):
            k, v = self.kv[seq]
            ks = k[:, :n].repeat_interleave(g, 0)
            vs = v[:, :n].repeat_interleave(g, 0)
            w = torch.einsum("hd,htd->ht", q[i].float(), ks.float()) / math.sqrt(a["head_dim"])
            lse[i] = torch.logsumexp(w, -1)
            out[i] = torch.einsum("ht,htd->hd", w.softmax(-1), vs.float()).to(q.dtype)
        return out, lse

    def attend_prefix(self, seq, q, lengths=None):
        self.calls.append(("prefix", q.shape[0]))
        return self._attend(q, [seq] * q.shape[0], lengths)

    def decode(self, q, seqs):
        assert q.shape[0] == len(seqs)
        self.calls.append(("decode", len(seqs)))
        return self._attend(q, seqs, [self.seq_len(s) for s in seqs])

    def bytes_per_token(self):
        return 4.0 * self.args["head_dim"] + 1.0

    def seq_len(self, seq):
        k = self.kv[seq][0]
        return 0 if k is None else k.shape[1]

    @property
    def num_kv_heads(self):
        return self.args["num_kv_heads"]

    def memory_report(self):
        n = sum(self.seq_len(s) for s in self.kv) * self.num_kv_heads
        return [{"tier": "fp16", "tokens": n, "resident_bytes": n * self.bytes_per_token()}]


class _FakeController:
    """kvforge.Controller's API: records what it was asked (the real one is tested on the GPU)."""

    made = []

    def __init__(self, cache, policy="rdr", budget=None, **kw):
        self.cache, self.policy, self.budget, self.kw = cache, policy, budget, kw
        self.applied = []
        _FakeController.made.append(self)

    def apply(self, cache, seq, token_mass=None):
        assert cache is self.cache
        self.applied.append((seq, token_mass.clone()))
        return ("report", self.policy, self.budget)


@pytest.fixture
def fake(monkeypatch):
    pytest.importorskip("torch")
    mod = types.ModuleType("kvforge")
    mod.Cache = _FakeCache
    mod.Controller = _FakeController
    mod.__version__ = "fake"
    monkeypatch.setitem(sys.modules, "kvforge", mod)
    _FakeCache.made = []
    _FakeController.made = []
    return mod


@pytest.fixture
def hf():
    return _load_hf()


def test_attend_prefix_then_decode_appends_only_new_tokens(fake, hf):
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 100, 16, generator=g)
    k = torch.randn(2, 100, 16, generator=g)
    v = torch.randn(2, 100, 16, generator=g)
    att = hf.KvforgeAttention("specs/rdkv.toml", "b4", max_tokens=128)

    def ref(tq, s, scaling):  # eager causal attention, queries at the last tq of s positions
        ks, vs = k[:, :s].repeat_interleave(3, 0), v[:, :s].repeat_interleave(3, 0)
        mask = torch.ones(tq, s, dtype=torch.bool).tril(diagonal=s - tq)
        o = torch.nn.functional.scaled_dot_product_attention(q[:, s - tq:s], ks, vs, attn_mask=mask, scale=scaling)
        return o.transpose(0, 1)

    out = att.attend(0, q[:, :90], k[:, :90], v[:, :90], 0.25)  # prompt of 90 tokens
    assert out.shape == (90, 6, 16)
    assert torch.allclose(out, ref(90, 90, 0.25), atol=1e-5)
    for s in (91, 92):  # two decode steps, transformers passing every K/V
        out = att.attend(0, q[:, s - 1:s], k[:, :s], v[:, :s], 0.25)
        assert torch.allclose(out, ref(1, s, 0.25), atol=1e-5)
    out = att.attend(0, q[:, 92:100], k[:, :100], v[:, :100], 0.3)  # a chunk of 8 queries, other scaling
    assert torch.allclose(out, ref(8, 100, 0.3), atol=1e-5)
    cache = att.layers[0]["cache"]
    assert cache.calls == [("append_device", 90), ("prefix", 90), ("append_step", 1), ("decode", 1), ("append_step", 1),
                           ("decode", 1), ("append_device", 8), ("prefix", 8)]
    assert cache.args == dict(spec="specs/rdkv.toml", head_dim=16, num_kv_heads=2, gqa=3, max_tokens=128,
                              target="b4", root=None, device=0)
    assert cache.kw == {"target_only": True}
    assert att.bytes_per_token() == 65.0
    # a new sequence (queries cover every key, or fewer keys than held) empties the cache and
    # reuses it (no spherical or mixed-key tiers)
    out = att.attend(0, q[:, :10], k[:, :10], v[:, :10], 0.25)
    assert att.layers[0]["cache"] is cache and att.layers[0]["n"] == 10 and cache.seq_len(0) == 10
    assert cache.calls[8:] == [("remove", 0), ("append_device", 10), ("prefix", 10)]
    assert torch.allclose(out, ref(10, 10, 0.25), atol=1e-5)
    out = att.attend(0, q[:, 4:5], k[:, :5], v[:, :5], 0.25)
    assert att.layers[0]["cache"] is cache and att.layers[0]["n"] == 5 and cache.seq_len(0) == 5
    k5, v5 = k[:, :5].repeat_interleave(3, 0), v[:, :5].repeat_interleave(3, 0)
    want = torch.nn.functional.scaled_dot_product_attention(q[:, 4:5], k5, v5, scale=0.25).transpose(0, 1)
    assert torch.allclose(out, want, atol=1e-5)
    assert len(_FakeCache.made) == 1
    att.reset()
    assert att.layers == {}


def test_shape_and_dtype_checks(fake, hf):
    import torch

    att = hf.KvforgeAttention()
    q, k = torch.zeros(6, 4, 16), torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="multiple"):
        att.attend(0, torch.zeros(5, 4, 16), k, k, 0.25)
    with pytest.raises(ValueError, match="share one dtype"):
        att.attend(0, q.half(), k, k, 0.25)
    with pytest.raises(ValueError, match="do not match"):
        att.attend(0, q, k, torch.zeros(2, 3, 16), 0.25)
    with pytest.raises(ValueError, match="queries but only"):
        att.attend(0, torch.zeros(6, 5, 16), k, k, 0.25)
    with pytest.raises(ValueError, match="heads, tokens, head_dim"):
        att.attend(0, q[None], k, k, 0.25)
    assert _FakeCache.made == []  # refused before any cache is made


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                                   attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, torch


def test_use_kvforge_forward_with_labels_and_generate(fake, hf):
    model, torch = _tiny_llama()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids)
        ref_gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)

        kv = hf.use_kvforge(model, spec="specs/rdkv.toml", tier="b4", root="/repo")
        assert model.config._attn_implementation == "kvforge"
        assert math.isnan(kv.bytes_per_token())
        out = model(input_ids=ids, labels=ids)
        assert torch.allclose(out.logits, ref.logits, atol=1e-4)
        assert abs(out.loss.item() - ref.loss.item()) < 1e-5
        assert len(_FakeCache.made) == 2  # one per layer
        c = _FakeCache.made[0]
        assert c.args["num_kv_heads"] == 2 and c.args["gqa"] == 3 and c.args["head_dim"] == 16
        assert c.args["max_tokens"] == 1024 + 256 and c.args["root"] == "/repo" and c.args["target"] == "b4"
        assert c.kw == {"target_only": True}
        assert c.calls == [("append_device", 40)]  # the prompt: exact SDPA, stored on the device
        assert kv.prefill == "sdpa"

        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert torch.equal(gen, ref_gen)
        assert len(_FakeCache.made) == 2  # the new prompt reused the layers' caches
        assert c.calls[1:3] == [("remove", 0), ("append_device", 40)]
        assert c.calls[3:] == [("append_step", 1), ("decode", 1)] * 5  # 6 new tokens: the last is not attended
        assert c.k.shape[1] == 45
        assert hf.bytes_per_token(model) == kv.bytes_per_token() == c.bytes_per_token()
        assert set(kv.memory_report()) == {0, 1}

        kv.detach()
        assert model.config._attn_implementation == "eager"
        assert torch.allclose(model(input_ids=ids).logits, ref.logits)
        with pytest.raises(RuntimeError, match="use_kvforge"):
            hf.bytes_per_token(model)


def test_attention_function_needs_a_handle(fake, hf):
    model, torch = _tiny_llama()
    hf.register()
    model.config._attn_implementation = "kvforge"  # registered, but use_kvforge not called
    with pytest.raises(RuntimeError, match="use_kvforge"), torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))


def test_smollm2_example_on_cpu(fake, hf, monkeypatch):
    """examples/smollm2.py end to end on CPU (fp32) with the fake extension: the kvforge row
    (exact attention) must match eager. Needs the GGUF and texts of benches/quality/prepare.py."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    repo = Path(__file__).resolve().parents[3]
    model_dir = repo / "data" / "model"
    if not (model_dir / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() or not (repo / "data/austen/prideprejudice.txt").is_file():
        pytest.skip("data/model and data/austen not prepared (benches/quality/prepare.py)")
    import torch

    fake.hf = hf
    monkeypatch.setitem(sys.modules, "kvforge.hf", hf)
    spec = importlib.util.spec_from_file_location("smollm2_example", repo / "crates/kvforge-py/examples/smollm2.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = ex.main([str(model_dir), "--device", "cpu", "--dtype", "fp32", "--tokens", "96", "--new-tokens", "4"])
    (_, ppl_ref, _, gen_ref, _), (name, ppl, bpt, gen, _) = rows
    assert name == "kvforge specs/rdkv.toml:b4"
    assert abs(ppl - ppl_ref) < 1e-3 * ppl_ref and bpt == 4.0 * 64 + 1
    assert gen == gen_ref
    assert len(_FakeCache.made) == 30  # per layer: one, emptied for the generate prompt


def test_exact_attention_matches_eager_and_sums_columns(hf):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    hq, hkv, s, d = 6, 2, 37, 16
    for tq in (37, 5, 1):
        q = torch.randn(hq, tq, d, generator=g, dtype=torch.float64)
        k = torch.randn(hkv, s, d, generator=g, dtype=torch.float64)
        v = torch.randn(hkv, s, d, generator=g, dtype=torch.float64)
        out, mass = hf.exact_attention(q, k, v, 0.25, chunk=4)
        # f64 reference, query i at position s - tq + i
        ref = torch.empty(tq, hq, d, dtype=torch.float64)
        col = torch.zeros(hkv, s, dtype=torch.float64)
        for h in range(hq):
            for i in range(tq):
                n = s - tq + i + 1
                w = torch.softmax((k[h // 3, :n] @ q[h, i]) * 0.25, 0)
                ref[i, h] = w @ v[h // 3, :n]
                col[h // 3, :n] += w
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
        assert torch.allclose(mass, col, atol=1e-9)
        assert torch.allclose(mass.sum(1), torch.full((hkv,), 3.0 * tq, dtype=torch.float64))
        alone, none = hf.exact_attention(q, k, v, 0.25, chunk=4, column_sums=False)
        assert none is None and torch.equal(alone, out)
        # observe=n: the column sums of the last n queries only (chunks cut anywhere)
        for n in (1, 3, 7, 100):
            part = torch.zeros(hkv, s, dtype=torch.float64)
            for h in range(hq):
                for i in range(max(0, tq - n), tq):
                    m = s - tq + i + 1
                    part[h // 3, :m] += torch.softmax((k[h // 3, :m] @ q[h, i]) * 0.25, 0)
            same, obs = hf.exact_attention(q, k, v, 0.25, chunk=4, observe=n)
            assert torch.equal(same, out) and torch.allclose(obs, part, atol=1e-9), n
            assert torch.allclose(obs.sum(1), torch.full((hkv,), 3.0 * min(n, tq), dtype=torch.float64))
            # observe_weight=w: w × the window's sums + (1 − w) × min(n, tq) / tq × every query's
            for w in (0.0, 0.25, 1.0):
                _, mixed = hf.exact_attention(q, k, v, 0.25, chunk=4, observe=n, observe_weight=w)
                want = w * part + (1 - w) * (min(n, tq) / tq) * col
                assert torch.allclose(mixed, want, atol=1e-9), (n, w)
                assert torch.allclose(mixed.sum(1), torch.full((hkv,), 3.0 * min(n, tq), dtype=torch.float64))
            # keep=k: the k positions with the largest window sums weigh the head's whole mass
            _, kept = hf.exact_attention(q, k, v, 0.25, chunk=4, observe=n, observe_weight=0.5, keep=2)
            _, mixed = hf.exact_attention(q, k, v, 0.25, chunk=4, observe=n, observe_weight=0.5)
            top = part.topk(2, dim=1).indices
            for h in range(hkv):
                for t in range(s):
                    want = mixed[h].sum() if t in top[h].tolist() else mixed[h, t]
                    assert abs(kept[h, t].item() - float(want)) < 1e-9, (n, h, t)


def test_control_observe_is_checked_and_shown(hf):
    assert "observe=64" in repr(hf.Control("rdkv", 32.0, observe=64))
    assert hf.Control("rdkv", 32.0).observe is None
    assert "observe_weight=0.5" in repr(hf.Control("rdkv", 32.0, observe=64, observe_weight=0.5))
    assert "keep=8" in repr(hf.Control("rdkv", 32.0, observe=64, keep=8))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="keep must be a non-negative integer"):
            hf.Control("rdkv", 32.0, observe=64, keep=bad)
    with pytest.raises(ValueError, match="keep needs observe"):
        hf.Control("rdkv", 32.0, keep=8)
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="observe_weight must be a number in"):
            hf.Control("rdkv", 32.0, observe=64, observe_weight=bad)
    for bad in (0, -3, 1.5, True, "8"):
        with pytest.raises(ValueError, match="observe must be a positive integer"):
            hf.Control("rdkv", 32.0, observe=bad)


def test_control_attends_the_prompt_exactly_then_applies_per_layer(fake, hf):
    torch = pytest.importorskip("torch")
    att = hf.KvforgeAttention("specs/rdkv.toml", "b8", control=hf.Control("rdkv", budget=40.0, sinks=64))
    assert att.exact_prefill
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 10, 8, generator=g)
    k = torch.randn(2, 10, 8, generator=g)
    v = torch.randn(2, 10, 8, generator=g)
    out = att.attend(0, q, k, v, 1 / math.sqrt(8))
    ref, mass = hf.exact_attention(q, k, v, 1 / math.sqrt(8))
    assert torch.equal(out, ref)
    ctl, = _FakeController.made
    assert ctl.policy == "rdkv" and ctl.budget == 40.0 and ctl.kw == {"sinks": 64}
    assert len(ctl.applied) == 1 and torch.equal(ctl.applied[0][1], mass)
    assert att.reports[0] == ("report", "rdkv", 40.0)
    c, = _FakeCache.made
    assert c.calls == [("append_device", 10)]  # the prompt is stored, not attended through the cache
    # the next token attends the cache
    q1 = torch.randn(4, 1, 8, generator=g)
    k1 = torch.cat([k, torch.randn(2, 1, 8, generator=g)], 1)
    v1 = torch.cat([v, torch.randn(2, 1, 8, generator=g)], 1)
    att.attend(0, q1, k1, v1, 1 / math.sqrt(8))
    assert c.calls[-2:] == [("append_step", 1), ("decode", 1)]
    assert len(ctl.applied) == 1
    assert att.bytes_per_token() == 4.0 * 8 + 1.0


def test_shared_pages_and_mass(hf):
    torch = pytest.importorskip("torch")
    w0 = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0, 0.0]])
    w1 = torch.tensor([[0.0, 0.0, 0.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    # top 1 per head: positions 1, 7 (layer 0) and 4, 0 (layer 1); pages of 4 tokens
    assert hf.shared_pages([w0, w1], 1, 0, 4) == [0, 1]
    assert hf.shared_pages([w0, w1], 1, 1, 4) == [0, 1, 2]  # 7 + 1 = 8 reaches page 2
    assert hf.shared_pages([w0], 2, 0, 4) == [0, 1, 2]      # 9 is head 0's second
    m = torch.arange(20, dtype=torch.float64).reshape(2, 10)
    out = hf.share_mass(m, [2], 4)
    assert torch.equal(out[:, :8], m[:, :8])
    assert torch.allclose(out[:, 8:], (m.sum(1) / 4)[:, None].expand(-1, 2))


def test_control_share_waits_for_every_layer(fake, hf):
    torch = pytest.importorskip("torch")
    _FakeCache.page_tokens = 4
    try:
        ctl = hf.Control("rdkv", budget=40.0, observe=3, share=1, share_radius=0)
        assert "share=1, share_radius=0" in repr(ctl)
        att = hf.KvforgeAttention("specs/rdkv.toml", "b8", control=ctl)
        g = torch.Generator().manual_seed(5)
        qs = [torch.randn(4, 10, 8, generator=g) for _ in range(2)]
        ks = [torch.randn(2, 10, 8, generator=g) for _ in range(2)]
        vs = [torch.randn(2, 10, 8, generator=g) for _ in range(2)]
        for layer in range(2):
            att.attend(layer, qs[layer], ks[layer], vs[layer], 1 / math.sqrt(8))
        assert all(not c.applied for c in _FakeController.made)  # waiting for the prompt's last layer
        wins = [hf.exact_attention(qs[i], ks[i], vs[i], 1 / math.sqrt(8), observe=3)[1] for i in range(2)]
        pages = hf.shared_pages(wins, 1, 0, 4)
        att.flush_control()
        applied = [a for c in _FakeController.made for a in c.applied]
        assert len(applied) == 2 and sorted(att.reports) == [0, 1]
        for i, (_, mass) in enumerate(applied):
            assert torch.allclose(mass, hf.share_mass(wins[i], pages, 4))
        att.flush_control()  # nothing waits any more
        assert len([a for c in _FakeController.made for a in c.applied]) == 2
    finally:
        del _FakeCache.page_tokens
    for bad in (dict(share=1), dict(observe=8, share=-1), dict(observe=8, share_radius=4)):
        with pytest.raises(ValueError, match="share"):
            hf.Control("rdkv", 32.0, **bad)


def test_channel_order_is_seed_002_weights_heaviest_first(hf):
    torch = pytest.importorskip("torch")

    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 20, 8, generator=g)  # 2 kv heads × gqa 3
    k = torch.randn(2, 30, 8, generator=g)
    q[0:3, :, 5] *= 10.0  # kv head 0: channel 5 dominates through its queries
    k[1, :, 2] *= 10.0    # kv head 1: channel 2 through its keys
    order = hf.channel_order(q, k)
    assert len(order) == 16
    for h in range(2):
        row = order[h * 8:(h + 1) * 8]
        assert sorted(row) == list(range(8))
        w = [(q[3 * h:3 * h + 3, :, c].double().norm() * k[h, :, c].double().norm()).item() / math.sqrt(8) for c in range(8)]
        assert all(w[row[i]] >= w[row[i + 1]] for i in range(7))
    assert order[0] == 5 and order[8] == 2
    # ties keep channel order
    assert hf.channel_order(torch.ones(2, 4, 8), torch.ones(1, 4, 8)) == list(range(8))


def test_mixed_key_tiers_get_the_prompt_channel_order(fake, hf):
    import torch

    class _Mixed(_FakeCache):
        mixed_key_tiers = ["zb", "za4"]

        def set_channel_order(self, tier, order):
            assert not self.kv, "the order is set before the first append"
            self.calls.append(("order", tier, list(order)))

    fake.Cache = _Mixed
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(6, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g)
    att = hf.KvforgeAttention("specs/trizone.toml", "zb", max_tokens=64)
    att.attend(0, q, k, v, 1 / math.sqrt(8))
    calls = att.layers[0]["cache"].calls
    want = hf.channel_order(q, k)
    assert calls[:2] == [("order", "zb", want), ("order", "za4", want)] and calls[2] == ("append_device", 12)


class _FakeSphericalCache(_FakeCache):
    """A cache of specs/spherical.toml: tiers `high` (group 16, 64 codewords) and `mid` (16, 16),
    on the placeholder codebook until set_codebook."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.spherical_tiers = {"high": (16, 64), "mid": (16, 16)}
        self.set = []

    def set_codebook(self, tier, codebook, layer=None):
        self.set.append((tier, codebook, layer))

    @property
    def placeholder_codebook_tiers(self):
        return [t for t in self.spherical_tiers if t not in {s[0] for s in self.set}]


class _FakeCodebooks:
    def __init__(self, path, group=16, entries=64):
        self.path, self.group, self.entries, self.head_dim = path, group, entries, 16

    def layer(self, l):
        return []


def test_spherical_placeholder_warns_once_and_codebooks_go_to_matching_tiers(fake, hf):
    import torch

    fake.Cache = _FakeSphericalCache
    fake.Codebooks = _FakeCodebooks
    q, k = torch.randn(6, 8, 16), torch.randn(2, 8, 16)
    att = hf.KvforgeAttention("specs/spherical.toml", "high")
    with pytest.warns(UserWarning, match="placeholder codebook"):
        att.attend(0, q, k, k, 0.25)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        att.attend(1, q, k, k, 0.25)  # once per handle
    att = hf.KvforgeAttention("specs/spherical.toml", "high", codebooks="cb.safetensors")
    with pytest.warns(UserWarning, match="mid"):  # `mid` (16 codewords) stays on the placeholder
        att.attend(3, q, k, k, 0.25)
    (tier, cb, layer), = att.layers[3]["cache"].set
    assert (tier, cb.path, layer) == ("high", "cb.safetensors", 3)
    with pytest.raises(ValueError, match="fit no spherical tier"):
        hf.KvforgeAttention("specs/spherical.toml", "high", codebooks=_FakeCodebooks("x", group=8)).attend(0, q, k, k, 0.25)


# ---------------------------------------------------------------------------------------------
# Batches: one sequence per row, padding free

def test_row_spans_find_left_padding_and_holes(hf):
    assert hf.row_spans([[1, 1, 1], [0, 0, 1], [0, 0, 0], [True, False, True], [1, 1, 0]]) == [
        (0, None), (2, None), (3, None), (2, [0, 2]), (2, [0, 1])]
    assert hf.real_positions((2, None), 5) == [2, 3, 4]
    assert hf.real_positions((2, [0, 3]), 5) == [0, 3]
    assert hf.row_spans([]) == []


def test_prefill_modes_are_checked(fake, hf):
    assert hf.KvforgeAttention().prefill == "cache"
    assert hf.KvforgeAttention(exact_prefill=True).prefill == "exact"
    assert hf.KvforgeAttention(prefill="sdpa").prefill == "sdpa"
    with pytest.raises(ValueError, match="one of"):
        hf.KvforgeAttention(prefill="fast")
    with pytest.raises(ValueError, match="exact"):
        hf.KvforgeAttention(control=hf.Control(), prefill="sdpa")


def test_window_policy_reaches_every_layer_cache(fake, hf):
    import torch

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(6, 20, 16, generator=g), torch.randn(2, 20, 16, generator=g), torch.randn(2, 20, 16, generator=g)
    att = hf.KvforgeAttention("specs/rotated.toml", "r3", max_tokens=128, sink_pages=1, recent_pages=2)
    att.attend(0, q, k, v, 0.25)
    assert att.layers[0]["cache"].kw == {"target_only": True, "sink_pages": 1, "recent_pages": 2}
    assert att.describe()["sink_pages"] == 1 and att.describe()["recent_pages"] == 2
    # the default leaves the caches' arguments as they were (every page coded as it fills)
    plain = hf.KvforgeAttention("specs/rotated.toml", "r3", max_tokens=128)
    plain.attend(0, q, k, v, 0.25)
    assert plain.layers[0]["cache"].kw == {"target_only": True}
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="recent_pages must be a non-negative integer"):
            hf.KvforgeAttention("specs/rotated.toml", "r3", recent_pages=bad)
    with pytest.raises(ValueError, match="controller keeps its own sinks"):
        hf.KvforgeAttention("specs/rotated.toml", "r3", control=hf.Control(), sink_pages=1)
    with pytest.raises(ValueError, match="certified decode does not cover"):
        hf.KvforgeAttention("specs/rotated.toml", "r3", certify=object(), recent_pages=2)


def test_mask_function_passes_padding_only(hf):
    torch = pytest.importorskip("torch")
    assert hf.no_mask(attention_mask=None) is None
    assert hf.no_mask(attention_mask=torch.ones(2, 5, dtype=torch.long)) is None
    m = torch.ones(2, 5, dtype=torch.long)
    m[1, :2] = 0
    got = hf.no_mask(attention_mask=m, kv_length=4)
    assert got.dtype == torch.bool and torch.equal(got, m[:, 1:].bool())
    assert torch.equal(hf.no_mask(attention_mask=m), m.bool())


@pytest.mark.parametrize("prefill", ["sdpa", "cache", "exact"])
def test_attend_batch_rows_are_their_own_sequences(fake, hf, prefill):
    """A padded batch (left padding, a row with a hole, an empty row) then two decode steps:
    every real query gets what it gets alone; padded query positions are zero."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, s, d = 4, 6, 2, 12, 8
    q = torch.randn(b, hq, s + 2, d, generator=g)
    k = torch.randn(b, hkv, s + 2, d, generator=g)
    v = torch.randn(b, hkv, s + 2, d, generator=g)
    mask = torch.ones(b, s + 2, dtype=torch.bool)
    mask[1, :5] = False          # left padding
    mask[2, 3] = False           # a hole
    mask[3, :s] = False          # nothing real in the prompt
    att = hf.KvforgeAttention(prefill=prefill)
    if prefill == "exact":
        mask[2, 3] = True        # exact takes left padding only
    sc = 1 / math.sqrt(d)

    def alone(row, upto, tq):  # causal attention of the row's real tokens, queries at the last tq positions
        real = [p for p in range(upto) if mask[row, p]]
        out = torch.zeros(tq, hq, d)
        for p in range(upto - tq, upto):
            if not mask[row, p]:
                continue
            seen = [r for r in real if r <= p]
            ks, vs = k[row, :, seen].repeat_interleave(3, 0), v[row, :, seen].repeat_interleave(3, 0)
            w = torch.softmax(torch.einsum("hd,htd->ht", q[row, :, p], ks) * sc, -1)
            out[p - (upto - tq)] = torch.einsum("ht,htd->hd", w, vs)
        return out

    out = att.attend_batch(0, q[:, :, :s], k[:, :, :s], v[:, :, :s], sc, mask[:, :s])
    assert out.shape == (b, s, hq, d)
    for row in range(b):
        assert torch.allclose(out[row], alone(row, s, s), atol=1e-5), (prefill, row)
    c = att.layers[0]["cache"]
    assert [c.seq_len(x) for x in att.layers[0]["seqs"]] == [int(mask[r, :s].sum()) for r in range(b)]
    for t in (s + 1, s + 2):  # decode steps: one append_step and one decode for the batch
        out = att.attend_batch(0, q[:, :, t - 1:t], k[:, :, :t], v[:, :, :t], sc, mask[:, :t])
        assert out.shape == (b, 1, hq, d)
        for row in range(b):
            assert torch.allclose(out[row], alone(row, t, 1), atol=1e-5), (prefill, row, t)
    assert c.calls[-4:] == [("append_step", 4), ("decode", 4)] * 2


def test_batch_generate_with_left_padding_matches_one_by_one(fake, hf):
    model, torch = _tiny_llama()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (7, 19, 12, 1)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        eager = [model.generate(input_ids=p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8,
                                do_sample=False)[0, len(p):] for p in prompts]
        kv = hf.use_kvforge(model)
        alone = [model.generate(input_ids=p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8,
                                do_sample=False)[0, len(p):] for p in prompts]
        batch = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)[:, width:]
        c = kv.layers[0]["cache"]
        assert [c.seq_len(x) for x in kv.layers[0]["seqs"]] == [len(p) + 7 for p in prompts]
        kv.detach()
    for i in range(len(prompts)):
        assert torch.equal(alone[i], eager[i]), i
        assert torch.equal(batch[i], alone[i]), (i, batch[i], alone[i])


def test_generate_sends_each_layer_its_new_token_only(fake, hf):
    # kvforge.hf.generate: one prompt forward, then decode forwards whose attention gets the
    # step's own token (PassKV: transformers keeps no KV copy); the same greedy tokens as
    # model.generate, alone and in a left-padded batch.
    model, torch = _tiny_llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (1, 40), generator=g)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (7, 19, 1)]
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        kv = hf.use_kvforge(model)
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[:, 40:]
        ref_batch = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=5, do_sample=False)[:, width:]
        got = hf.generate(model, ids, max_new_tokens=6)
        c = kv.layers[0]["cache"]
        assert c.calls[-10:] == [("append_step", 1), ("decode", 1)] * 5
        assert c.k.shape[1] == 45 and kv.layers[0]["n"] == 45
        got_batch = hf.generate(model, batch, mask, max_new_tokens=5)
        assert hf.handle_of(model) is kv and not kv._step_mode
        kv.detach()
    assert torch.equal(got, ref), (got, ref)
    assert torch.equal(got_batch, ref_batch), (got_batch, ref_batch)
    assert hf.prompt_positions(mask).tolist()[2] == [1] * (width - 1) + [0]


def test_score_is_the_eager_teacher_forced_nll(fake, hf):
    # kvforge.hf.score: a prompt forward, then one decode step per token; each step's logits
    # score the next token. On exact attention it is the one-forward teacher-forced NLL.
    model, torch = _tiny_llama()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (2, 30), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ref = -torch.log_softmax(logits[:, 9:-1].float(), -1).gather(-1, ids[:, 10:, None])[..., 0]
        kv = hf.use_kvforge(model)
        got = hf.score(model, ids, prefix=10)
        c = kv.layers[0]["cache"]
        assert c.calls[-4:] == [("append_step", 2), ("decode", 2)] * 2
        with pytest.raises(ValueError, match="prefix 30"):
            hf.score(model, ids, prefix=30)
        kv.detach()
    assert got.shape == (2, 20)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
