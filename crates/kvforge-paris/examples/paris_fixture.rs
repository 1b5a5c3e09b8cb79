//! Writes the fixture that `benches/quality/test_paris_sim.py` checks the Python port
//! (`benches/quality/paris_sim.py`) against: the f64 reference's summaries, bonus tables,
//! collision scores, top-C candidates and reranked top-k on small deterministic inputs.
//!
//! ```text
//! cargo run --release -p kvforge-paris --example paris_fixture > benches/quality/fixtures/paris-reference.json
//! ```
//!
//! **Inputs** (reproduced bit for bit by the Python test, IEEE f64 arithmetic in the order
//! written): a xorshift64 stream seeded with `salt · 0x9e3779b97f4a7c15 | 1`, `u = (s >> 11) / 2^53`;
//! key `i`, channel `c`: `mean_c = ((37c) mod 17)/8 − 1`, `cen_j(c) = ((131j + 29c) mod 23)/11 − 1`
//! with `j = i mod 7`, `noise = u₁ + u₂ + u₃ − 1.5` (three draws, in order), and
//! `k_ic = f32(1.5 mean_c + cen_j(c) + 0.8 noise)`; key 5 is zero. Query `r`:
//! `q_c = 1.3 cen_{r+1}(c) + 0.5 noise + 0.3 mean_c` (f64), drawn after all keys. The runs
//! retrieve for each query and for the GQA group's summed query of all three
//! (`group_query`: `((q₀ + q₁) + q₂)` in f64, the per-kv-head retrieval of the runtime).
//!
//! Integer arrays are compared by their FNV-1a 64 hash of the little-endian bytes (the file
//! stays small); the first keys' summaries, the candidates and the top-k are listed.
//!
//! `whole64` (each case): the same keys under the 64 B summaries of the runtime's default
//! (`SummaryLayout::Whole64` = `Layout::whole_eighth`): the level tables, the codes and weight
//! codes on the grid fitted to all keys, and for each run the top-k reranked by the whole-vector
//! estimate (`CompactQuery`), and for the group also by the largest of the three heads'
//! estimates (`Rank::GroupMax`, as `retrieve_group_compact`). The vote and the candidates are
//! those of `runs` (the ids are the codes' sign plane).

use half::f16;
use kvforge_paris::retrieval::top_k_by;
use kvforge_paris::{group_query, summarize_key, top_candidates, CompactQuery, CompactSummaries, Layout, ParisConfig, Query, Summaries};
use serde_json::{json, Value};

struct Xorshift(u64);

impl Xorshift {
    fn new(salt: u64) -> Xorshift {
        Xorshift(salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn uniform(&mut self) -> f64 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        (*s >> 11) as f64 / (1u64 << 53) as f64
    }

    fn noise(&mut self) -> f64 {
        let (a, b, c) = (self.uniform(), self.uniform(), self.uniform());
        a + b + c - 1.5
    }
}

fn mean_c(c: usize) -> f64 {
    ((37 * c) % 17) as f64 / 8.0 - 1.0
}

fn cen(j: usize, c: usize) -> f64 {
    ((131 * j + 29 * c) % 23) as f64 / 11.0 - 1.0
}

fn fnv(bytes: impl IntoIterator<Item = u8>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn case(d: usize, n: usize, salt: u64) -> Value {
    let cfg = ParisConfig::default_for(d);
    let mut rng = Xorshift::new(salt);
    let mut keys = vec![0f32; n * d];
    for i in 0..n {
        for c in 0..d {
            let v = 1.5 * mean_c(c) + cen(i % 7, c) + 0.8 * rng.noise();
            keys[i * d + c] = if i == 5 { 0.0 } else { v as f32 };
        }
    }
    let queries: Vec<Vec<f64>> = (0..3).map(|r| (0..d).map(|c| 1.3 * cen(r + 1, c) + 0.5 * rng.noise() + 0.3 * mean_c(c)).collect()).collect();
    let s = Summaries::encode(cfg, &keys).expect("finite keys");
    let first: Vec<Value> = (0..8)
        .map(|i| {
            let k = summarize_key(&cfg, &keys[i * d..(i + 1) * d]);
            json!({"ids": k.ids, "codes": k.codes, "weights_f16_bits": k.weights.iter().map(|&w| f16::from_f32(w).to_bits()).collect::<Vec<_>>()})
        })
        .collect();
    let layout = Layout::whole_eighth();
    let cs = CompactSummaries::encode(cfg, layout, &keys).expect("finite keys");
    let low: Vec<usize> = (0..d).filter(|&j| layout.is_low(&cfg, j)).collect();
    let (t4, t3) = (layout.table(&cfg, 0), layout.table(&cfg, low[0]));
    let heads: Vec<CompactQuery> = queries.iter().map(|q| CompactQuery::new(&Query::new(&cfg, q).expect("a finite query"), layout).expect("layout")).collect();
    let mut whole_runs = Vec::new();
    let mut runs = Vec::new();
    // Per query head (`query` 0, 1, 2), then the GQA group's shared retrieval (module docs of
    // kvforge-paris, "GQA"): the summed query of heads 0..3 (`query` "group", `group_query`).
    let group: Vec<f64> = group_query(&queries.concat(), d);
    let all: Vec<(Value, &[f64])> = queries.iter().enumerate().map(|(qi, q)| (json!(qi), q.as_slice())).chain(std::iter::once((json!("group"), group.as_slice()))).collect();
    for (qi, q) in all {
        let qp = Query::new(&cfg, q).expect("a finite query");
        for &(rho, c, k) in &[(0.25, 300usize, 40usize), (0.10, 150, 20)] {
            let bonus = qp.bonuses(&s.hist, s.n, rho);
            let scores = qp.vote(&s, rho);
            let cands = top_candidates(&scores, c);
            let top = top_k_by(cands.iter().map(|&i| (qp.estimate(&s, i as usize), i)).collect(), k);
            let cq = CompactQuery::new(&qp, layout).expect("layout");
            let whole = top_k_by(cands.iter().map(|&i| (cq.estimate(&cs, i as usize), i)).collect(), k);
            let mut w = json!({"query": qi.clone(), "rho": rho, "candidates": c, "k": k, "top": whole.iter().map(|&(e, i)| json!([i, e])).collect::<Vec<_>>()});
            if qi == json!("group") {
                let hmax = top_k_by(cands.iter().map(|&i| (heads.iter().map(|h| h.estimate(&cs, i as usize)).fold(f64::NEG_INFINITY, f64::max), i)).collect(), k);
                w["top_hmax"] = json!(hmax.iter().map(|&(e, i)| json!([i, e])).collect::<Vec<_>>());
            }
            whole_runs.push(w);
            runs.push(json!({
                "query": qi, "rho": rho, "candidates": c, "k": k, "norm": qp.norm,
                "bonus_fnv": fnv(bonus.iter().copied()),
                "scores_fnv": fnv(scores.iter().flat_map(|v| v.to_le_bytes())),
                "score_max": scores.iter().max(),
                "candidate_ids": cands,
                "top": top.iter().map(|&(e, i)| json!([i, e])).collect::<Vec<_>>(),
            }));
        }
    }
    json!({
        "head_dim": d, "n": n, "salt": salt, "config": cfg,
        "levels_f32": cfg.levels().levels_f32, "thresholds_f32": cfg.levels().thresholds_f32,
        "keys_sum": keys.iter().map(|&v| f64::from(v)).sum::<f64>(),
        "keys_first": &keys[..8],
        "queries": queries,
        "group_query": group,
        "ids_fnv": fnv(s.ids.iter().copied()),
        "codes_fnv": fnv(s.codes.iter().copied()),
        "weights_fnv": fnv(s.weights.iter().flat_map(|w| w.to_le_bytes())),
        "hist_fnv": fnv(s.hist.iter().flat_map(|h| h.to_le_bytes())),
        "first_keys": first,
        "runs": runs,
        "whole64": {
            "levels4_f32": t4.levels_f32, "thresholds4_f32": t4.thresholds_f32,
            "levels3_f32": t3.levels_f32, "thresholds3_f32": t3.thresholds_f32,
            "low": low, "steps": layout.steps(), "grid_base": cs.grid.base,
            "codes_fnv": fnv(cs.codes.iter().copied()),
            "weights_fnv": fnv(cs.weights.iter().copied()),
            "first_keys": (0..8).map(|i| json!({"codes": &cs.codes[i * d..(i + 1) * d], "weight_code": cs.weights[i]})).collect::<Vec<_>>(),
            "runs": whole_runs,
        },
    })
}

fn main() {
    let out = json!({
        "what": "kvforge-paris f64 reference on deterministic inputs (crates/kvforge-paris/examples/paris_fixture.rs states them); checked by benches/quality/test_paris_sim.py",
        "hash": "FNV-1a 64 of the little-endian bytes: ids u8 [n][B], codes u8 [n][D/2] packed, weights fp16 bits u16 [n][B], hist u32 [B][2^m], bonus u8 [B][2^m], scores u16 [n]; whole64: codes u8 [n][D] level indices, weights u8 [n] grid codes",
        "cases": [case(64, 3000, 1), case(128, 2000, 2)],
    });
    println!("{}", serde_json::to_string(&out).expect("json"));
}
