//! Exact softmax attention in f64, the answer every decode kernel is measured against.
//!
//! For one query head q over n keys: s_t = sm_scale · ⟨q, k_t⟩, m = max_t s_t,
//! out = Σ_t e^{s_t − m} v_t / Σ_t e^{s_t − m}, lse = m + ln Σ_t e^{s_t − m} (natural log).
//! Subtracting m keeps every exponent ≤ 0, so nothing overflows. With no keys the sums are
//! empty: out = 0 and lse = −∞, the identity of the split-K merge ([`combine_partials`]).

/// Attention of one query head `q` (`[d]`, d = `q.len()`) over `k`, `v` (`[n][d]`).
/// Returns (out `[d]`, lse).
///
/// # Panics
/// If `k` and `v` are not `[n][d]` for the same n, or `q` is empty.
pub fn attention(q: &[f64], k: &[f64], v: &[f64], sm_scale: f64) -> (Vec<f64>, f64) {
    let d = q.len();
    assert!(d > 0, "attention: the query is empty (head_dim 0)");
    assert!(k.len() % d == 0 && v.len() == k.len(), "attention: k ({}) and v ({}) must be [n][{d}]", k.len(), v.len());
    let logits: Vec<f64> = k.chunks_exact(d).map(|kt| sm_scale * dot(q, kt)).collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![0f64; d];
    if logits.is_empty() {
        return (out, f64::NEG_INFINITY);
    }
    let mut den = 0f64;
    for (s, vt) in logits.iter().zip(v.chunks_exact(d)) {
        let p = (s - m).exp();
        den += p;
        for (o, &x) in out.iter_mut().zip(vt) {
            *o += p * x;
        }
    }
    out.iter_mut().for_each(|o| *o /= den);
    (out, m + den.ln())
}

/// The softmax weights of one query head over `k` (`[n][d]`); they sum to 1.
pub fn softmax_weights(q: &[f64], k: &[f64], sm_scale: f64) -> Vec<f64> {
    let d = q.len();
    let logits: Vec<f64> = k.chunks_exact(d).map(|kt| sm_scale * dot(q, kt)).collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|s| (s - m).exp()).collect();
    let den: f64 = e.iter().sum();
    e.iter().map(|x| x / den).collect()
}

/// Attention of the `q.len() / d` query heads of one GQA group (`[gqa][d]`) sharing one kv head.
/// Returns (out `[gqa][d]`, lse `[gqa]`).
pub fn attention_heads(q: &[f64], d: usize, k: &[f64], v: &[f64], sm_scale: f64) -> (Vec<f64>, Vec<f64>) {
    assert!(d > 0 && q.len() % d == 0, "attention_heads: q ({}) must be [gqa][{d}]", q.len());
    let mut out = Vec::with_capacity(q.len());
    let mut lse = Vec::with_capacity(q.len() / d);
    for qh in q.chunks_exact(d) {
        let (o, l) = attention(qh, k, v, sm_scale);
        out.extend(o);
        lse.push(l);
    }
    (out, lse)
}

/// Keys and values of one (sequence, kv head), `[n][d]` each.
#[derive(Clone, Copy, Debug)]
pub struct KvHead<'a> {
    pub k: &'a [f64],
    pub v: &'a [f64],
}

/// Decode attention of a batch: `heads[b · hkv + h]` is the cache of sequence b, kv head h,
/// and `q` is `[batch · hkv][gqa][d]` in the same order (query head h·gqa + g attends kv head
/// h). Returns (out, lse) in the query's row order.
pub fn batched_gqa_attention(q: &[f64], d: usize, gqa: usize, heads: &[KvHead<'_>], sm_scale: f64) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(q.len(), heads.len() * gqa * d, "batched_gqa_attention: q must be [{} kv heads][{gqa}][{d}]", heads.len());
    let mut out = Vec::with_capacity(q.len());
    let mut lse = Vec::with_capacity(heads.len() * gqa);
    for (qg, h) in q.chunks_exact(gqa * d).zip(heads) {
        let (o, l) = attention_heads(qg, d, h.k, h.v, sm_scale);
        out.extend(o);
        lse.extend(l);
    }
    (out, lse)
}

/// Merges attention over disjoint key sets (split-K): each partial is (out `[d]`, lse).
/// Partials with lse = −∞ (no keys) carry no weight. Equals [`attention`] over the union.
pub fn combine_partials(partials: &[(&[f64], f64)]) -> (Vec<f64>, f64) {
    let d = partials.first().map_or(0, |p| p.0.len());
    let m = partials.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![0f64; d];
    if m == f64::NEG_INFINITY {
        return (out, m);
    }
    let mut den = 0f64;
    for (o, l) in partials {
        let w = (l - m).exp();
        den += w;
        for (acc, &x) in out.iter_mut().zip(o.iter()) {
            *acc += w * x;
        }
    }
    out.iter_mut().for_each(|o| *o /= den);
    (out, m + den.ln())
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_keys_give_zero_and_minus_infinity() {
        let (o, l) = attention(&[1.0, 2.0], &[], &[], 1.0);
        assert_eq!(o, vec![0.0, 0.0]);
        assert_eq!(l, f64::NEG_INFINITY);
    }

    #[test]
    fn huge_logits_do_not_overflow() {
        let (o, l) = attention(&[1.0], &[1e6, 1e6 - 1.0], &[1.0, 3.0], 1.0);
        let w = 1.0 / (1.0 + (-1f64).exp());
        assert!((o[0] - (w + 3.0 * (1.0 - w))).abs() < 1e-12);
        assert!((l - (1e6 + (1.0 + (-1f64).exp()).ln())).abs() < 1e-6);
    }

    #[test]
    fn lse_is_natural_log() {
        let (_, l) = attention(&[0.0], &[5.0, 7.0, 9.0], &[0.0; 3], 1.0);
        assert!((l - 3f64.ln()).abs() < 1e-15);
    }
}
