"""CPU tests of paris_sim.py (pytest): the torch port against the kvforge-paris f64 reference
(fixtures/paris-reference.json, written by `cargo run --release -p kvforge-paris --example
paris_fixture`; per query and for the GQA group's summed query), the batched causal backend
against a per-position brute force (per kv head and per query head), and a tiny random Llama
through the attention interface."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kvq  # noqa: E402
import paris_sim as ps  # noqa: E402

FIXTURE = HERE / "fixtures" / "paris-reference.json"
M64 = (1 << 64) - 1


class Xorshift:
    """The fixture's stream (crates/kvforge-paris/examples/paris_fixture.rs)."""

    def __init__(self, salt):
        self.s = ((salt * 0x9E3779B97F4A7C15) & M64) | 1

    def uniform(self):
        s = self.s
        s ^= (s << 13) & M64
        s ^= s >> 7
        s ^= (s << 17) & M64
        self.s = s
        return (s >> 11) / float(1 << 53)

    def noise(self):
        a, b, c = self.uniform(), self.uniform(), self.uniform()
        return a + b + c - 1.5


def mean_c(c):
    return ((37 * c) % 17) / 8.0 - 1.0


def cen(j, c):
    return ((131 * j + 29 * c) % 23) / 11.0 - 1.0


def inputs(d, n, salt):
    rng = Xorshift(salt)
    keys = np.zeros((n, d), dtype=np.float64)
    for i in range(n):
        for c in range(d):
            v = 1.5 * mean_c(c) + cen(i % 7, c) + 0.8 * rng.noise()
            keys[i, c] = 0.0 if i == 5 else v
    queries = [[1.3 * cen(r + 1, c) + 0.5 * rng.noise() + 0.3 * mean_c(c) for c in range(d)] for r in range(3)]
    return torch.from_numpy(keys.astype(np.float32)), torch.tensor(queries, dtype=torch.float64)


def fnv(b: bytes) -> str:
    h = 0xCBF29CE484222325
    for x in b:
        h = ((h ^ x) * 0x100000001B3) & M64
    return f"{h:016x}"


def le(t: torch.Tensor, dtype) -> bytes:
    return t.cpu().numpy().astype(dtype).tobytes()


@pytest.fixture(scope="module")
def fixture():
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("case_ix", [0, 1])
def test_port_matches_reference(fixture, case_ix):
    case = fixture["cases"][case_ix]
    d, n = case["head_dim"], case["n"]
    cfg = ps.Config(d)
    assert cfg.b == case["config"]["subspaces"] and cfg.tiers == case["config"]["tiers"] and cfg.seed == case["config"]["seed"]
    assert ps.LEVELS[cfg.m] == case["levels_f32"]
    keys, queries = inputs(d, n, case["salt"])
    assert keys[:1, :8].flatten().tolist() == case["keys_first"]
    assert float(keys.double().sum()) == pytest.approx(case["keys_sum"], rel=1e-12)
    assert queries.tolist() == case["queries"]
    group = ps.group_queries(queries, 3)[0]  # the reference's group_query of the three, bit for bit
    assert group.tolist() == case["group_query"]

    ids, codes, w = ps.summarize(keys, cfg)
    for i, fk in enumerate(case["first_keys"]):
        assert ids[i].tolist() == fk["ids"], f"key {i}"
        assert codes[i].tolist() == fk["codes"], f"key {i}"
        assert w[i].half().view(torch.int16).numpy().astype(np.uint16).tolist() == fk["weights_f16_bits"], f"key {i}"
    assert fnv(le(ids, np.uint8)) == case["ids_fnv"]
    assert fnv(le(ps.pack_codes(codes), np.uint8)) == case["codes_fnv"]
    assert fnv(w.half().view(torch.int16).numpy().astype("<u2").tobytes()) == case["weights_fnv"]
    hist = ps.histogram(ids, cfg)
    assert fnv(le(hist, "<u4")) == case["hist_fnv"]

    rows = ps.key_estimate_rows(codes, w, cfg)
    everything = torch.ones(n, dtype=torch.bool)
    assert {r["query"] for r in case["runs"]} == {0, 1, 2, "group"}
    for run in case["runs"]:
        q = group if run["query"] == "group" else queries[run["query"]]
        nrm, qr, order = ps.prepare_queries(q, cfg)
        assert float(nrm) == run["norm"]
        bonus = ps.bonuses(order, hist, torch.tensor(n), torch.tensor(run["rho"], dtype=torch.float64), cfg.tiers)
        assert fnv(le(bonus, np.uint8)) == run["bonus_fnv"], run
        scores = ps.vote(bonus, ids)
        assert int(scores.max()) == run["score_max"]
        assert fnv(le(scores, "<u2")) == run["scores_fnv"], run
        cmask = ps.top_c_mask(scores, everything, torch.tensor(run["candidates"]))
        assert torch.nonzero(cmask).flatten().tolist() == run["candidate_ids"], run
        est = torch.matmul(qr * nrm, rows.T)
        sel = ps.top_k_mask(est, cmask, torch.tensor(run["k"]))
        got = sorted(torch.nonzero(sel).flatten().tolist(), key=lambda i: (-float(est[i]), i))
        assert got == [i for i, _ in run["top"]], run
        for i, e in run["top"]:
            assert float(est[i]) == pytest.approx(e, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("case_ix", [0, 1])
def test_whole64_port_matches_reference(fixture, case_ix):
    """The 64 B summaries (the runtime's default layout): tables, codes and weight codes on the
    grid fitted to all keys, and the top-k the whole-vector estimate reranks from the vote's
    candidates (per query and the group's summed query, and for the group by the largest of
    the three heads' estimates, `Rank::GroupMax`)."""
    case = fixture["cases"][case_ix]
    w64 = case["whole64"]
    d, n = case["head_dim"], case["n"]
    cfg = ps.Config(d)
    l4, l3, t4, t3 = ps.whole_tables(d)
    assert l4.tolist() == w64["levels4_f32"] and l3.tolist() == w64["levels3_f32"]
    assert t4.tolist() == w64["thresholds4_f32"] and t3.tolist() == w64["thresholds3_f32"]
    assert torch.nonzero(ps.whole_low(d)).flatten().tolist() == w64["low"] and w64["steps"] == ps.WHOLE_STEPS
    keys, queries = inputs(d, n, case["salt"])
    group = ps.group_queries(queries, 3)[0]
    codes, logw, valid = ps.summarize_whole(keys, cfg)
    base = ps.whole_grid_base(logw, valid)
    assert base == w64["grid_base"]
    wcode, wval = ps.whole_weights(logw, valid, base)
    for i, fk in enumerate(w64["first_keys"]):
        assert codes[i].tolist() == fk["codes"], f"key {i}"
        assert int(wcode[i]) == fk["weight_code"], f"key {i}"
    assert fnv(le(codes, np.uint8)) == w64["codes_fnv"]
    assert fnv(le(wcode, np.uint8)) == w64["weights_fnv"]
    rows = ps.whole_levels(codes) * wval[:, None]
    ids, _, _ = ps.summarize(keys, cfg)
    assert torch.equal(ps.whole_ids(codes, cfg), ids)  # the sign plane is the ids
    hist = ps.histogram(ids, cfg)
    everything = torch.ones(n, dtype=torch.bool)

    def estimate(q):
        nrm, qr, _ = ps.prepare_queries(q, cfg)
        return torch.matmul(qr * nrm, rows.T)

    def top(est, cmask, k):
        sel = ps.top_k_mask(est, cmask, torch.tensor(k))
        return sorted(torch.nonzero(sel).flatten().tolist(), key=lambda i: (-float(est[i]), i))

    for run in w64["runs"]:
        q = group if run["query"] == "group" else queries[run["query"]]
        _, _, order = ps.prepare_queries(q, cfg)
        bonus = ps.bonuses(order, hist, torch.tensor(n), torch.tensor(run["rho"], dtype=torch.float64), cfg.tiers)
        cmask = ps.top_c_mask(ps.vote(bonus, ids), everything, torch.tensor(run["candidates"]))
        est = estimate(q)
        assert top(est, cmask, run["k"]) == [i for i, _ in run["top"]], run
        for i, e in run["top"]:
            assert float(est[i]) == pytest.approx(e, rel=1e-9, abs=1e-9)
        if run["query"] == "group":
            hmax = torch.stack([estimate(queries[h]) for h in range(3)]).amax(0)
            assert top(hmax, cmask, run["k"]) == [i for i, _ in run["top_hmax"]], run
            for i, e in run["top_hmax"]:
                assert float(hmax[i]) == pytest.approx(e, rel=1e-9, abs=1e-9)


def brute_force(be: ps.ParisSimBackend, q, k, v, scaling):
    """Per query position: the regions, a fresh summary of the region's keys and the
    single-query pipeline for each retrieval (a query head's query, or per kv head the sum of
    its group's, which every head of the group then attends), attention in f64."""
    hq, tq, d = q.shape
    hkv, s, _ = k.shape
    g = hq // hkv
    cfg = ps.Config(d, be.tiers)
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    for t in range(tq):
        p = s - tq + t
        s0 = min(be.sinks, p + 1)
        r = max(p + 1 - be.local, s0)
        n = r - s0
        for h in range(hq):
            kh = h // g
            allowed = torch.zeros(s, dtype=torch.bool)
            allowed[: p + 1] = True
            if n >= be.dense_below and n > be.k:
                allowed[s0:r] = False
                reg = k[kh, s0:r]
                qr_in = q[h, t].double() if be.per_query_head else sum((q[kh * g + i, t].double() for i in range(g)), torch.zeros(d, dtype=torch.float64))
                if be.oracle:
                    ex = torch.matmul(reg.double(), qr_in)
                    top = torch.sort(ex, descending=True, stable=True).indices[: be.k]
                else:
                    rho, _, c, kk, _ = ps.plan(n, be.k, be.dense_below, be.schedule)
                    ids, codes, w = ps.summarize(reg, cfg)
                    nrm, qr, order = ps.prepare_queries(qr_in, cfg)
                    bonus = ps.bonuses(order, ps.histogram(ids, cfg), torch.tensor(n), torch.tensor(rho, dtype=torch.float64), cfg.tiers)
                    cm = ps.top_c_mask(ps.vote(bonus, ids), torch.ones(n, dtype=torch.bool), torch.tensor(c))
                    if be.whole64:  # a fresh prefill of the region: its own weight grid
                        wc, logw, valid = ps.summarize_whole(reg, cfg)
                        _, wval = ps.whole_weights(logw, valid, ps.whole_grid_base(logw, valid))
                        rows = ps.whole_levels(wc) * wval[:, None]
                    else:
                        rows = ps.key_estimate_rows(codes, w, cfg)
                    est = torch.matmul(qr * nrm, rows.T)
                    top = torch.nonzero(ps.top_k_mask(est, cm, torch.tensor(kk))).flatten()
                allowed[s0 + top] = True
            lg = torch.matmul(k[kh].double(), q[h, t].double()) * scaling
            lg[~allowed] = -math.inf
            out[t, h] = torch.matmul(torch.softmax(lg, 0), v[kh].double())
    return out


@pytest.mark.parametrize("whole64", [False, True])
@pytest.mark.parametrize("per_query_head", [False, True])
@pytest.mark.parametrize("oracle", [False, True])
def test_backend_equals_per_position_brute_force(oracle, per_query_head, whole64):
    if oracle and whole64:
        pytest.skip("the oracle reads no summaries")
    torch.manual_seed(0)
    hq, hkv, s, d = 4, 2, 160, 64
    k = torch.randn(hkv, s, d) + torch.linspace(-1, 1, d)
    k[:, 40] *= 3.0  # a key past the prefix's top weight: later grids move
    v = torch.randn(hkv, s, d)
    q = torch.randn(hq, s, d) * 2
    be = ps.ParisSimBackend("t", k=6, sinks=4, local=12, dense_below=40, oracle=oracle, per_query_head=per_query_head, whole64=whole64)
    be.reset()
    got = be.attend(0, q, k, v, 0.125)
    want = brute_force(be, q, k, v, 0.125)
    assert torch.allclose(got.double(), want, atol=1e-5), (got.double() - want).abs().max()
    # Decode: one query at a time against the growing cache gives the same rows.
    be.reset()
    for t in (150, 159):
        one = be.attend(0, q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1], 0.125)
        assert torch.allclose(one[0].double(), want[t], atol=1e-5)
    if not oracle:
        rc = be.stats["recall_vs_exact_topk_by_layer"]["0"]
        assert 0.0 < rc <= 1.0


def test_backend_dense_when_short_and_names_parse():
    torch.manual_seed(1)
    q, k, v = torch.randn(4, 50, 64), torch.randn(2, 50, 64), torch.randn(2, 50, 64)
    be = ps.ParisSimBackend.parse("sim:paris-k8-s4-l8-d2048")
    assert (be.k, be.sinks, be.local, be.dense_below, be.oracle, be.per_query_head) == (8, 4, 8, 2048, False, False)
    assert torch.equal(be.attend(0, q, k, v, 0.125), kvq.eager_causal(q, k, v, 0.125))
    assert ps.ParisSimBackend.parse("sim:paris-k256-oracle").oracle
    w = ps.ParisSimBackend.parse("sim:paris-k256-hmax-w64")
    assert w.whole64 and w.head_max and w.schedule == ps.SCHEDULE_WHOLE64 and w.bytes_per_token(128) == 64.0
    assert w.describe()["layout"].startswith("whole64")
    # Schedule::whole64: ρ 0.30 from 64K keys.
    assert ps.plan(128 << 10, 100, schedule=ps.SCHEDULE_WHOLE64)[:2] == (0.30, 0.10)
    qh = ps.ParisSimBackend.parse("sim:paris-k256-qhead-oracle")
    assert qh.per_query_head and qh.oracle and qh.describe()["retrieval"] == "per query head"
    assert ps.ParisSimBackend.parse("sim:paris-k256").describe()["retrieval"].startswith("per kv head")
    with pytest.raises(SystemExit):
        ps.ParisSimBackend.parse("sim:paris-x3")
    assert isinstance(kvq.make_backend("sim:paris-k256"), ps.ParisSimBackend)
    assert ps.plan(5000, 100) == (0.25, 0.10, 800, 100, False)
    assert ps.plan(1000, 100)[4]
    # Schedule::default (crates/kvforge-paris config.rs, its test schedule_plans_by_length).
    assert ps.plan(128 << 10, 100)[:3] == (0.20, 0.10, math.ceil(0.10 * (128 << 10)))
    assert ps.plan(1 << 20, 100)[:3] == (0.20, 0.05, math.ceil(0.05 * (1 << 20)))


def test_group_of_one_is_per_query_head_and_groups_share_rows():
    """With GQA 1 the per-kv-head backend is the per-query-head one; with GQA 2 a group's heads
    attend the same retrieved rows (same selection, so equal outputs for equal queries)."""
    torch.manual_seed(3)
    s, d = 120, 64
    k = torch.randn(2, s, d) + torch.linspace(-1, 1, d)
    v = torch.randn(2, s, d)
    q = torch.randn(2, s, d) * 2
    kw = dict(k=6, sinks=4, local=12, dense_below=40)
    a = ps.ParisSimBackend("kv", **kw).attend(0, q, k, v, 0.125)
    b = ps.ParisSimBackend("qh", per_query_head=True, **kw).attend(0, q, k, v, 0.125)
    assert torch.equal(a, b)
    # GQA 2, both heads of kv head 0 carrying the same query: per kv head their summed query
    # is 2q (same direction, same selection as q alone), so they match the per-head run.
    q2 = torch.stack([q[0], q[0], q[1], q[1]])
    c = ps.ParisSimBackend("kv", **kw).attend(0, q2, k, v, 0.125)
    assert torch.equal(c[:, 0], c[:, 1]) and torch.equal(c[:, 2], c[:, 3])
    assert torch.allclose(c[:, 0], b[:, 0], atol=1e-6) and torch.allclose(c[:, 2], b[:, 1], atol=1e-6)


def test_tiny_llama_runs_with_retrieval():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(2)
    kvq.register_attention()
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = kvq.ATTN_NAME
    ids = torch.randint(0, 97, (1, 200))

    def loss(backend):
        kvq.set_backend(backend)
        with torch.no_grad():
            return float(model(input_ids=ids, labels=ids, use_cache=False).loss)

    ref = loss(kvq.Fp16Backend())
    assert loss(ps.ParisSimBackend("all", k=8, sinks=4, local=16, dense_below=10_000)) == ref
    assert loss(ps.ParisSimBackend("wide", k=512, sinks=4, local=16, dense_below=20)) == pytest.approx(ref, abs=1e-6)
    be = ps.ParisSimBackend("narrow", k=8, sinks=4, local=16, dense_below=20)
    got = loss(be)
    assert math.isfinite(got) and got != ref
    assert set(be.stats["recall_vs_exact_topk_by_layer"]) == {"0", "1"}
    assert be.stats["retrieval_queries"] > 0
