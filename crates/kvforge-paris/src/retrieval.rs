//! Decode-time retrieval (seed 001 §4.2.2), f64 reference: collision voting over the
//! centroid ids, an integer-bucket top-`C` of the collision scores, the 4-bit rerank
//! estimate (eq. 10) of the candidates, top-`k`.
//!
//! **Vote.** The query `q` is normalised and rotated like the keys, `q̃ = R q̂`. In subspace `b`
//! the `2^m` centroids are ranked by `⟨q̃_b, ω⟩ ∝ Σ_j ±q̃_bj` (descending, ties by id). Walking
//! them in that order with `before` = keys in the centroids already passed (from the
//! occupancy histogram), a centroid gets bonus `T − ⌊before · T / ⌈ρ n⌉⌋` while
//! `before < ⌈ρ n⌉`, else 0: the centroids that hold the `ρ` fraction of keys nearest the
//! query's direction vote, the nearest in the highest of `T` tiers ("multi-tier collision
//! shaping", §5.4; `T = 1` is plain collision counting). Ranking by keys rather than by a
//! fixed count of centroids keeps `ρ` meaningful when real keys crowd a few sign patterns.
//! A key's score is the sum of its `B` bonuses, in `[0, B·T]`.
//!
//! **Top-C.** With `t` the largest score such that at least `C` keys score `≥ t`: every key
//! scoring `> t`, then the keys scoring exactly `t` in index order until there are `C`
//! (the device's integer bucket top-k fills the boundary bucket in index order too).
//!
//! **Rerank.** `ŝ_i = ‖q‖ Σ_b w_ib Σ_j ℓ_{c_ij} q̃_bj` (eq. 10), top-`k` by `ŝ` descending,
//! ties by index.
//!
//! **GQA.** The `G` query heads of a kv head share one retrieval (one top-`k`, one fetch of
//! the rows from host memory): its query is [`group_query`], the sum of the heads' queries. A
//! key's aggregated score is the sum of the heads' logits, `Σ_g ⟨k, q_g⟩ = ⟨k, Σ_g q_g⟩`, and
//! eq. 10 is linear in `q` (`‖q‖ q̃ = R q`), so the estimate for the summed query is the sum of
//! the heads' estimates: the rerank ranks by the group's summed rerank scores, and the vote ranks
//! centroids by the summed query's direction. Recall is then measured per kv head against
//! [`exact_top_k`] of the summed query (the exact top-`k` of the aggregated scores).
//!
//! **Group maximum** ([`Rank::GroupMax`], "hmax"). The sum ranks a key that one head of the
//! group attends to strongly below keys that every head likes moderately (on SmolLM2 the
//! summed mode loses a needle that per-query-head retrieval finds, docs/paris.md). With
//! `GroupMax` the vote and top-`C` stay those of the summed query (one per kv head), but the
//! rerank ranks each candidate by the largest of the `G` heads' own eq. 10 estimates,
//! `max_g ŝ_g(i)`, top-`k` of that, ties by index ([`retrieve_group_max`]). Recall is measured
//! against [`exact_top_k_group_max`], the exact top-`k` by `max_g ⟨k_i, q_g⟩`.

use kvforge_spec::codecs::rotated::hadamard;
use serde::{Deserialize, Serialize};

use crate::compact::{CompactQuery, CompactSummaries};
use crate::config::{check_ratios, ParisConfig};
use crate::error::ParisError;
use crate::summary::Summaries;

/// A query prepared for one head's summaries.
#[derive(Clone, Debug)]
pub struct Query {
    pub config: ParisConfig,
    /// `‖q‖`.
    pub norm: f64,
    /// `q̃ = R q̂`, `[D]`.
    pub rotated: Vec<f64>,
    /// `[B][2^m]` centroids by decreasing `⟨q̃_b, ω⟩`.
    pub order: Vec<u16>,
    /// `[D][16]`: `ℓ_c · q̃_j`, the rerank's lookup table.
    lut: Vec<f64>,
}

impl Query {
    /// Prepares `q` (`[D]`, finite).
    pub fn new(config: &ParisConfig, q: &[f64]) -> Result<Query, ParisError> {
        config.validate()?;
        let (d, m, cents) = (config.head_dim, config.m(), config.centroids());
        if q.len() != d {
            return Err(ParisError::Length { what: "query", got: q.len(), want: d });
        }
        if q.iter().any(|v| !v.is_finite()) {
            return Err(ParisError::NonFinite { what: "query", row: 0 });
        }
        let norm = q.iter().map(|v| v * v).sum::<f64>().sqrt();
        let mut rotated: Vec<f64> = q.iter().map(|v| if norm > 0.0 { v / norm } else { 0.0 }).collect();
        hadamard::rotate(config.seed, &mut rotated);
        let mut order = Vec::with_capacity(config.subspaces * cents);
        for b in 0..config.subspaces {
            let sub = &rotated[b * m..(b + 1) * m];
            let score = |w: usize| (0..m).map(|j| if w >> j & 1 == 1 { sub[j] } else { -sub[j] }).sum::<f64>();
            let mut ws: Vec<(f64, u16)> = (0..cents).map(|w| (score(w), w as u16)).collect();
            ws.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            order.extend(ws.into_iter().map(|(_, w)| w));
        }
        let levels = &config.levels().levels_f32;
        let lut = rotated.iter().flat_map(|&qj| levels.iter().map(move |&l| f64::from(l) * qj)).collect();
        Ok(Query { config: *config, norm, rotated, order, lut })
    }

    /// Per-subspace bonus of every centroid, `[B][2^m]`, for `n` keys with occupancy `hist`.
    pub fn bonuses(&self, hist: &[u32], n: usize, rho: f64) -> Vec<u8> {
        let (cents, tiers) = (self.config.centroids(), u64::from(self.config.tiers));
        let target = ((rho * n as f64).ceil() as u64).max(1);
        let mut out = vec![0u8; self.config.subspaces * cents];
        for b in 0..self.config.subspaces {
            let mut before = 0u64;
            for &w in &self.order[b * cents..(b + 1) * cents] {
                if before >= target {
                    break;
                }
                out[b * cents + w as usize] = (tiers - before * tiers / target) as u8;
                before += u64::from(hist[b * cents + w as usize]);
            }
        }
        out
    }

    /// Collision scores of every key (`[n]`).
    pub fn vote(&self, s: &Summaries, rho: f64) -> Vec<u16> {
        let (bsub, cents) = (self.config.subspaces, self.config.centroids());
        let bonus = self.bonuses(&s.hist, s.n, rho);
        s.ids.chunks_exact(bsub).map(|ids| ids.iter().enumerate().map(|(b, &w)| u16::from(bonus[b * cents + w as usize])).sum()).collect()
    }

    /// The eq. 10 estimate of `⟨k_i, q⟩`.
    pub fn estimate(&self, s: &Summaries, i: usize) -> f64 {
        let (d, m) = (self.config.head_dim, self.config.m());
        let row = &s.codes[i * d / 2..(i + 1) * d / 2];
        let mut acc = 0.0;
        for b in 0..self.config.subspaces {
            let mut dot = 0.0;
            for j in b * m..(b + 1) * m {
                let c = (row[j / 2] >> (4 * (j % 2))) & 15;
                dot += self.lut[j * 16 + c as usize];
            }
            acc += s.weight(i, b) * dot;
        }
        self.norm * acc
    }
}

/// The `c` keys the vote keeps, ascending by index (module docs, "Top-C").
pub fn top_candidates(scores: &[u16], c: usize) -> Vec<u32> {
    let c = c.min(scores.len());
    if c == 0 {
        return Vec::new();
    }
    let max = scores.iter().copied().max().unwrap_or(0) as usize;
    let mut hist = vec![0usize; max + 1];
    scores.iter().for_each(|&s| hist[s as usize] += 1);
    let (mut t, mut above) = (max, 0usize);
    while above + hist[t] < c {
        above += hist[t];
        t -= 1;
    }
    let mut room = c - above;
    let mut out = Vec::with_capacity(c);
    for (i, &s) in scores.iter().enumerate() {
        if s as usize > t {
            out.push(i as u32);
        } else if s as usize == t && room > 0 {
            room -= 1;
            out.push(i as u32);
        }
    }
    out
}

/// The `k` largest of `(score, index)` pairs, by score descending then index ascending.
pub fn top_k_by(mut scored: Vec<(f64, u32)>, k: usize) -> Vec<(f64, u32)> {
    let k = k.min(scored.len());
    let cmp = |a: &(f64, u32), b: &(f64, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if k < scored.len() && k > 0 {
        scored.select_nth_unstable_by(k - 1, cmp);
    }
    scored.truncate(k);
    scored.sort_by(cmp);
    scored
}

/// What one retrieval found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Retrieval {
    /// The vote's candidates, by index.
    pub candidates: Vec<u32>,
    /// The top-`k` after the rerank with their estimates, best first.
    pub top: Vec<(f64, u32)>,
}

impl Retrieval {
    /// The retrieved indices, best first.
    pub fn indices(&self) -> Vec<u32> {
        self.top.iter().map(|&(_, i)| i).collect()
    }
}

/// How the rerank of a GQA group's shared retrieval ranks its candidates (module docs, "GQA"
/// and "Group maximum"). The vote and top-`C` are those of the summed query either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Rank {
    /// By the eq. 10 estimate of the summed query ([`group_query`]): the sum of the heads'
    /// estimates. One estimate per candidate.
    Summed,
    /// By the largest of the group's heads' own eq. 10 estimates. The default: the one mode
    /// with one retrieval per kv head whose quality met issue 27's target in the SmolLM2
    /// simulation (`sim:paris-k256-hmax`, needle 3/3 where `Summed` found 2/3; docs/paris.md);
    /// its cost is `G` estimates per candidate in the rerank instead of one.
    #[default]
    GroupMax,
}

impl Rank {
    /// Parses `sum` / `summed` or `max` / `group_max` / `hmax` (the CLI and Python spelling).
    pub fn parse(s: &str) -> Option<Rank> {
        match s {
            "sum" | "summed" => Some(Rank::Summed),
            "max" | "group_max" | "hmax" => Some(Rank::GroupMax),
            _ => None,
        }
    }

    /// `sum` or `max`.
    pub fn name(self) -> &'static str {
        match self {
            Rank::Summed => "sum",
            Rank::GroupMax => "max",
        }
    }
}

/// Vote with `q` and `rho`, keep `candidates`, score each candidate with `score`, keep `k`.
fn retrieve_scored(s: &Summaries, q: &Query, rho: f64, candidates: usize, k: usize, score: impl Fn(usize) -> f64) -> Result<Retrieval, ParisError> {
    check_ratios(rho, rho.min(1.0))?;
    if k > s.n {
        return Err(ParisError::TopK { k, n: s.n });
    }
    let cands = top_candidates(&q.vote(s, rho), candidates.max(k));
    let scored = cands.iter().map(|&i| (score(i as usize), i)).collect();
    Ok(Retrieval { top: top_k_by(scored, k), candidates: cands })
}

/// Vote with `rho`, keep `candidates`, rerank, keep `k`.
pub fn retrieve(s: &Summaries, q: &Query, rho: f64, candidates: usize, k: usize) -> Result<Retrieval, ParisError> {
    retrieve_scored(s, q, rho, candidates, k, |i| q.estimate(s, i))
}

/// [`Rank::GroupMax`] (module docs): vote and top-`C` with the group's summed query `group`
/// ([`group_query`] of the heads), rerank each candidate by the largest of `heads`' estimates,
/// keep `k` (ties by index). The top's scores are those maxima. No heads is an error.
pub fn retrieve_group_max(s: &Summaries, group: &Query, heads: &[Query], rho: f64, candidates: usize, k: usize) -> Result<Retrieval, ParisError> {
    if heads.is_empty() {
        return Err(ParisError::Length { what: "group-max query heads", got: 0, want: 1 });
    }
    retrieve_scored(s, group, rho, candidates, k, |i| heads.iter().map(|h| h.estimate(s, i)).fold(f64::NEG_INFINITY, f64::max))
}

/// One retrieval of a GQA group under `rank`: `heads` is the group's queries `[G][D]` flattened.
/// [`Rank::Summed`] is [`retrieve`] with [`group_query`]; [`Rank::GroupMax`] is
/// [`retrieve_group_max`].
pub fn retrieve_group(s: &Summaries, heads: &[f64], rank: Rank, rho: f64, candidates: usize, k: usize) -> Result<Retrieval, ParisError> {
    let cfg = &s.config;
    let d = cfg.head_dim;
    if heads.is_empty() || heads.len() % d != 0 {
        return Err(ParisError::Length { what: "group queries", got: heads.len(), want: d });
    }
    let group = Query::new(cfg, &group_query(heads, d))?;
    match rank {
        Rank::Summed => retrieve(s, &group, rho, candidates, k),
        Rank::GroupMax => {
            let per = heads.chunks_exact(d).map(|q| Query::new(cfg, q)).collect::<Result<Vec<_>, _>>()?;
            retrieve_group_max(s, &group, &per, rho, candidates, k)
        }
    }
}

/// [`retrieve_group`] with the rerank on compact summaries `c` of the same keys
/// ([`crate::SummaryLayout::Whole64`] on the device): the vote and top-`C` read `s`'s ids and
/// occupancy (the codes' sign plane, so they are `c`'s), the candidates are ranked by
/// [`CompactQuery::estimate`] of the summed query or the largest of the heads'.
pub fn retrieve_group_compact(s: &Summaries, c: &CompactSummaries, heads: &[f64], rank: Rank, rho: f64, candidates: usize, k: usize) -> Result<Retrieval, ParisError> {
    let cfg = &s.config;
    let d = cfg.head_dim;
    if c.config != *cfg || c.n != s.n {
        return Err(ParisError::Layout(format!("compact summaries of {} keys under {:?} for summaries of {} keys under {cfg:?}", c.n, c.config, s.n)));
    }
    if heads.is_empty() || heads.len() % d != 0 {
        return Err(ParisError::Length { what: "group queries", got: heads.len(), want: d });
    }
    let group = Query::new(cfg, &group_query(heads, d))?;
    match rank {
        Rank::Summed => {
            let cq = CompactQuery::new(&group, c.layout)?;
            retrieve_scored(s, &group, rho, candidates, k, |i| cq.estimate(c, i))
        }
        Rank::GroupMax => {
            let per = heads.chunks_exact(d).map(|q| Query::new(cfg, q).and_then(|q| CompactQuery::new(&q, c.layout))).collect::<Result<Vec<_>, _>>()?;
            retrieve_scored(s, &group, rho, candidates, k, |i| per.iter().map(|h| h.estimate(c, i)).fold(f64::NEG_INFINITY, f64::max))
        }
    }
}

/// The query of a GQA group's shared retrieval (module docs, "GQA"): the sum of the group's
/// query heads, `queries` being `[heads][D]` flattened. One head gives itself back.
pub fn group_query(queries: &[f64], d: usize) -> Vec<f64> {
    let mut out = vec![0.0; d];
    for q in queries.chunks_exact(d) {
        out.iter_mut().zip(q).for_each(|(o, &x)| *o += x);
    }
    out
}

/// The exact top-`k` of `[n][D]` keys by `⟨k_i, q⟩` (f64), best first.
pub fn exact_top_k(keys: &[f32], q: &[f64], k: usize) -> Vec<u32> {
    let d = q.len();
    let scored = keys.chunks_exact(d).enumerate().map(|(i, r)| (r.iter().zip(q).map(|(&a, b)| f64::from(a) * b).sum::<f64>(), i as u32)).collect();
    top_k_by(scored, k).into_iter().map(|(_, i)| i).collect()
}

/// The exact top-`k` of `[n][D]` keys by the largest of the group's logits,
/// `max_g ⟨k_i, q_g⟩` (f64), `heads` being `[G][D]` flattened; best first. What
/// [`Rank::GroupMax`] approximates.
pub fn exact_top_k_group_max(keys: &[f32], heads: &[f64], d: usize, k: usize) -> Vec<u32> {
    let scored = keys
        .chunks_exact(d)
        .enumerate()
        .map(|(i, r)| {
            let best = heads.chunks_exact(d).map(|q| r.iter().zip(q).map(|(&a, b)| f64::from(a) * b).sum::<f64>()).fold(f64::NEG_INFINITY, f64::max);
            (best, i as u32)
        })
        .collect();
    top_k_by(scored, k).into_iter().map(|(_, i)| i).collect()
}

/// `|got ∩ want| / |want|`.
pub fn recall(got: &[u32], want: &[u32]) -> f64 {
    if want.is_empty() {
        return 1.0;
    }
    let set: std::collections::HashSet<u32> = got.iter().copied().collect();
    want.iter().filter(|i| set.contains(i)).count() as f64 / want.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn gauss(rng: &mut ChaCha8Rng) -> f64 {
        let (u, v): (f64, f64) = (rng.gen::<f64>().max(1e-300), rng.gen());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    #[test]
    fn top_candidates_fills_the_boundary_bucket_in_index_order() {
        let s = [3u16, 1, 2, 2, 0, 2, 3];
        assert_eq!(top_candidates(&s, 3), vec![0, 2, 6]);
        assert_eq!(top_candidates(&s, 5), vec![0, 2, 3, 5, 6]);
        assert_eq!(top_candidates(&s, 7), (0..7).collect::<Vec<_>>());
        assert_eq!(top_candidates(&s, 0), Vec::<u32>::new());
        assert_eq!(top_candidates(&[0, 0, 0], 2), vec![0, 1]);
    }

    #[test]
    fn bonuses_cover_rho_of_the_keys_in_tiers() {
        let cfg = ParisConfig::default_for(64);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let keys: Vec<f32> = (0..64 * 4000).map(|_| gauss(&mut rng) as f32).collect();
        let s = Summaries::encode(cfg, &keys).unwrap();
        let q: Vec<f64> = (0..64).map(|_| gauss(&mut rng)).collect();
        let qp = Query::new(&cfg, &q).unwrap();
        let bonus = qp.bonuses(&s.hist, s.n, 0.2);
        for b in 0..cfg.subspaces {
            let row = &bonus[b * 256..(b + 1) * 256];
            let voted: u32 = (0..256).filter(|&w| row[w] > 0).map(|w| s.hist[b * 256 + w]).sum();
            // At least ρn, and at most ρn plus the last centroid's keys.
            let last = (0..256).filter(|&w| row[w] > 0).map(|w| s.hist[b * 256 + w]).max().unwrap();
            assert!(voted >= 800 && voted < 800 + last, "subspace {b}: {voted}");
            assert_eq!(row[qp.order[b * 256] as usize], cfg.tiers as u8);
            assert!(row.iter().all(|&x| x <= cfg.tiers as u8));
        }
        let scores = qp.vote(&s, 0.2);
        assert!(scores.iter().all(|&x| x as usize <= cfg.max_score()));
    }

    /// The Whole64 rerank keeps the seed layout's vote and candidates (its ids are the codes'
    /// sign plane) and finds nearly the same keys; mismatched summaries are an error.
    #[test]
    fn compact_rerank_keeps_the_vote() {
        let d = 128;
        let cfg = ParisConfig::default_for(d);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let keys: Vec<f32> = (0..d * 6000).map(|i| (gauss(&mut rng) + 0.8 * ((i % d) as f64 * 0.37).sin()) as f32).collect();
        let s = Summaries::encode(cfg, &keys).unwrap();
        let c = CompactSummaries::encode(cfg, crate::compact::Layout::whole_eighth(), &keys).unwrap();
        let heads: Vec<f64> = (0..4 * d).map(|_| gauss(&mut rng)).collect();
        for rank in [Rank::Summed, Rank::GroupMax] {
            let seed = retrieve_group(&s, &heads, rank, 0.3, 600, 100).unwrap();
            let whole = retrieve_group_compact(&s, &c, &heads, rank, 0.3, 600, 100).unwrap();
            assert_eq!(whole.candidates, seed.candidates, "{rank:?}");
            let want = match rank {
                Rank::Summed => exact_top_k(&keys, &group_query(&heads, d), 100),
                Rank::GroupMax => exact_top_k_group_max(&keys, &heads, d, 100),
            };
            let (rs, rw) = (recall(&seed.indices(), &want), recall(&whole.indices(), &want));
            let same = recall(&whole.indices(), &seed.indices());
            println!("{rank:?}: Recall@100 whole {rw} seed {rs}, top-k overlap {same}");
            assert!(rw > rs - 0.05 && same > 0.6, "{rank:?}: whole {rw} vs seed {rs}, overlap {same}");
        }
        let short = CompactSummaries::encode(cfg, crate::compact::Layout::whole_eighth(), &keys[..d * 10]).unwrap();
        assert!(matches!(retrieve_group_compact(&s, &short, &heads, Rank::Summed, 0.3, 600, 100), Err(ParisError::Layout(_))));
    }

    /// The estimate for a group's summed query is the sum of its heads' estimates (eq. 10 is
    /// linear in q), so one rerank with `group_query` ranks by the summed rerank scores.
    #[test]
    fn group_estimate_is_the_sum_of_the_heads_estimates() {
        let d = 64;
        let cfg = ParisConfig::default_for(d);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let keys: Vec<f32> = (0..d * 500).map(|_| gauss(&mut rng) as f32).collect();
        let s = Summaries::encode(cfg, &keys).unwrap();
        let heads: Vec<f64> = (0..4 * d).map(|_| gauss(&mut rng)).collect();
        let g = Query::new(&cfg, &group_query(&heads, d)).unwrap();
        let per: Vec<Query> = heads.chunks_exact(d).map(|q| Query::new(&cfg, q).unwrap()).collect();
        for i in 0..s.n {
            let sum: f64 = per.iter().map(|q| q.estimate(&s, i)).sum();
            assert!((g.estimate(&s, i) - sum).abs() <= 1e-9 * (1.0 + sum.abs()), "key {i}");
        }
        assert_eq!(group_query(&heads[..d], d), heads[..d].to_vec());
    }

    /// Group-max ranking keeps the summed query's candidates, scores each by its best head,
    /// equals the per-head retrieval for a group of one, and finds a key that only one head
    /// of the group wants where the summed ranking drops it.
    #[test]
    fn group_max_ranks_by_the_best_head() {
        let d = 64;
        let cfg = ParisConfig::default_for(d);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let n = 6000;
        let mut keys: Vec<f32> = (0..n * d).map(|_| gauss(&mut rng) as f32).collect();
        let mut heads: Vec<f64> = (0..4 * d).map(|_| gauss(&mut rng)).collect();
        // Head 0 points against heads 1..3 together (`q_0 = −0.7 Σ_{g>0} q_g`, so the group's sum
        // is `0.3 Σ_{g>0} q_g`), and a planted key lies along head 0: head 0's best key by far,
        // anti-aligned with the summed query.
        let special = 1234;
        for c in 0..d {
            heads[c] = -0.7 * (heads[d + c] + heads[2 * d + c] + heads[3 * d + c]);
        }
        let q0 = heads[..d].iter().map(|v| v * v).sum::<f64>().sqrt();
        for c in 0..d {
            keys[special * d + c] = (8.0 * heads[c] / q0) as f32;
        }
        let s = Summaries::encode(cfg, &keys).unwrap();
        let (rho, c, k) = (1.0, n, 50);
        let summed = retrieve_group(&s, &heads, Rank::Summed, rho, c, k).unwrap();
        let max = retrieve_group(&s, &heads, Rank::GroupMax, rho, c, k).unwrap();
        assert_eq!(summed.candidates, max.candidates, "one vote per kv head either way");
        let per: Vec<Query> = heads.chunks_exact(d).map(|q| Query::new(&cfg, q).unwrap()).collect();
        for &(e, i) in &max.top {
            let best = per.iter().map(|q| q.estimate(&s, i as usize)).fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(e, best);
        }
        assert!(max.indices().contains(&(special as u32)), "the max ranking keeps head 0's key");
        assert!(!summed.indices().contains(&(special as u32)), "the sum cancels head 0's key");
        let want = exact_top_k_group_max(&keys, &heads, d, k);
        assert!(want.contains(&(special as u32)));
        assert!(recall(&max.indices(), &want) > recall(&summed.indices(), &want));
        // A group of one: both rankings are the head's own retrieval.
        let one = retrieve(&s, &per[0], 0.25, 600, k).unwrap();
        assert_eq!(retrieve_group(&s, &heads[..d], Rank::GroupMax, 0.25, 600, k).unwrap(), one);
        assert_eq!(retrieve_group(&s, &heads[..d], Rank::Summed, 0.25, 600, k).unwrap(), one);
        assert!(retrieve_group_max(&s, &per[0], &[], 0.25, 600, k).is_err());
        assert_eq!(Rank::default(), Rank::GroupMax);
        assert_eq!(Rank::parse("max"), Some(Rank::GroupMax));
        assert_eq!(Rank::parse(Rank::Summed.name()), Some(Rank::Summed));
        assert_eq!(Rank::parse("mean"), None);
    }

    /// On isotropic keys with a planted near neighbour set, retrieval finds most of the exact
    /// top-k with 10% candidates.
    #[test]
    fn retrieval_recovers_planted_neighbours() {
        let d = 128;
        let cfg = ParisConfig::default_for(d);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 20_000;
        let q: Vec<f64> = (0..d).map(|_| gauss(&mut rng)).collect();
        let mut keys: Vec<f32> = (0..n * d).map(|_| gauss(&mut rng) as f32).collect();
        for i in (0..n).step_by(200) {
            for c in 0..d {
                keys[i * d + c] = (0.5 * q[c] + 0.8 * gauss(&mut rng)) as f32;
            }
        }
        let s = Summaries::encode(cfg, &keys).unwrap();
        let qp = Query::new(&cfg, &q).unwrap();
        let r = retrieve(&s, &qp, 0.25, n / 10, 100).unwrap();
        let want = exact_top_k(&keys, &q, 100);
        let rc = recall(&r.indices(), &want);
        assert!(rc >= 0.9, "recall {rc}");
        assert_eq!(r.candidates.len(), n / 10);
        assert!(r.candidates.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(retrieve(&s, &qp, 0.25, 10, n + 1).unwrap_err(), ParisError::TopK { k: n + 1, n });
    }
}
