//! The certificate: a bound on ‖Ô − O‖₂ for one query head from what the step achieved.
//!
//! Notation: exact logits s_t, used logits ŝ_t with |ŝ_t − s_t| ≤ Δ on the tokens T left
//! quantised and ŝ_t = s_t on the exact ones H (fp16 tail pages, promoted pages); achieved
//! weights p̂ = softmax(ŝ), exact p = softmax(s); α̂ = Σ_T p̂_t, the *achieved* tail mass.
//!
//! Ô − O = Σ_t p̂_t (v̂_t − v_t) + Σ_t (p̂_t − p_t) v_t.
//!
//! * Values: ‖Σ p̂_t (v̂_t − v_t)‖ ≤ Σ_pages ρ̂_page η_page = **E_val** (η = the page's largest
//!   ‖V_t − V̂_t‖₂, measured at encode time; exact pages have η = 0).
//! * Keys: ‖Σ (p̂_t − p_t) v_t‖ ≤ V_max Σ_t |p̂_t − p_t|. With r_t = p_t / p̂_t,
//!   Σ_t |p̂_t − p_t| = Σ_t p̂_t |1 − r_t|. Write x = Z/Ẑ (exact over achieved partition
//!   function): Z − Ẑ = Σ_T (e^{s_t} − e^{ŝ_t}) ∈ Ẑ·α̂·[e^{−Δ} − 1, e^{Δ} − 1], so
//!   x ∈ [L, U] = [1 − α̂(1 − e^{−Δ}), 1 + α̂(e^{Δ} − 1)]. On H, r_t = 1/x; on T,
//!   r_t = e^{s_t − ŝ_t}/x ∈ [e^{−Δ}/U, e^{Δ}/L]. Hence
//!   Σ|p̂ − p| ≤ (1 − α̂)·max(1 − 1/U, 1/L − 1) + α̂·max(1 − e^{−Δ}/U, e^{Δ}/L − 1),
//!   Independently of α̂, a logit perturbation of oscillation at most 2Δ moves a softmax by at
//!   most 2·tanh(Δ/2) in ℓ1 (the cap kvforge-ref's certificate also uses), so the factor is the
//!   smaller of the two: the first wins while α̂ is small, the cap on flat attention, where
//!   α̂ → 1 gives e^{2Δ} − 1 ≈ 2Δ against the cap's ≈ Δ.
//!   **E_key** = V_max times that. For small α̂, Δ it is ≈ 2 α̂ Δ V_max: half of seed
//!   004's eq. 15 (2 V_max e^{2Δ} α̂ (e^{2Δ} − 1) ≈ 4 α̂ Δ V_max), which is therefore also
//!   valid but looser. The bound uses the achieved α̂ (phase 2), not an estimate.
//! * Arithmetic (**E_round**): the fp16 (or bf16) rounding of the output, ≤ u/(1 − u)·‖Ô‖₂,
//!   plus a conservative fp32 accumulation term (n/8 + 128)·2⁻²⁴·V_max for n tokens (each
//!   thread's running sums are at most n/8 terms long; the kernels' reductions add ≤ 128
//!   levels). The paper has no such term; without it an exact rung would certify 0 and fail.

/// The three terms and their sum.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Certificate {
    pub e_key: f64,
    pub e_val: f64,
    pub e_round: f64,
    pub bound: f64,
}

/// Unit roundoff of the fp16 output.
const FP16_U: f64 = 1.0 / 2048.0;

/// E_key's factor Σ_t |p̂_t − p_t| ≤ tv(Δ, α̂) (see the module doc), capped by 2·tanh(Δ/2).
/// Δ = ∞ with α̂ > 0 gives ∞ (an unbounded score error escalates rather than certify 2·V_max).
pub fn total_variation(delta: f64, alpha: f64) -> f64 {
    if alpha <= 0.0 {
        return 0.0;
    }
    if !delta.is_finite() {
        return f64::INFINITY;
    }
    let lo = 1.0 - alpha * (1.0 - (-delta).exp());
    let hi = 1.0 + alpha * delta.exp_m1();
    let exact_part = (1.0 - 1.0 / hi).max(1.0 / lo - 1.0);
    let tail_part = (1.0 - (-delta).exp() / hi).max(delta.exp() / lo - 1.0);
    ((1.0 - alpha) * exact_part + alpha * tail_part).min(2.0 * (delta / 2.0).tanh())
}

/// The certificate of one head: Δ and α̂ over the pages left quantised, V_max over all tokens,
/// E_val = Σ ρ̂ η already summed, ‖Ô‖₂ and the token count for the arithmetic term.
pub fn certificate(delta: f64, alpha: f64, v_max: f64, e_val: f64, out_norm: f64, tokens: usize) -> Certificate {
    let e_key = v_max * total_variation(delta, alpha);
    let e_round = FP16_U / (1.0 - FP16_U) * out_norm + (tokens as f64 / 8.0 + 128.0) * 2f64.powi(-24) * v_max;
    Certificate { e_key, e_val, e_round, bound: e_key + e_val + e_round }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax(x: &[f64]) -> Vec<f64> {
        let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
        x.iter().map(|v| (v - m).exp() / z).collect()
    }

    fn l1(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum()
    }

    /// Brute force over two-level logit perturbations: the TV bound holds for the worst
    /// admissible perturbation of small instances.
    #[test]
    fn total_variation_bounds_worst_perturbations() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..20000 {
            let n = rng.gen_range(2..12);
            let delta: f64 = rng.gen_range(0.0..1.5);
            let s: Vec<f64> = (0..n).map(|_| rng.gen_range(-4.0..4.0)).collect();
            let tail: Vec<bool> = (0..n).map(|_| rng.gen_bool(0.5)).collect();
            // Extreme perturbations (±Δ) are where TV peaks.
            let e: Vec<f64> = (0..n)
                .map(|i| {
                    if tail[i] {
                        if rng.gen_bool(0.5) {
                            delta
                        } else {
                            -delta
                        }
                    } else {
                        0.0
                    }
                })
                .collect();
            let sh: Vec<f64> = s.iter().zip(&e).map(|(a, b)| a + b).collect();
            let ph = softmax(&sh);
            let alpha: f64 = (0..n).filter(|&i| tail[i]).map(|i| ph[i]).sum();
            let tv = l1(&softmax(&s), &ph);
            assert!(tv <= total_variation(delta, alpha) * (1.0 + 1e-12) + 1e-15, "tv {tv} > bound {} (Δ {delta}, α̂ {alpha})", total_variation(delta, alpha));
        }
    }

    /// Flat attention (every token quantised, α̂ = 1): the tanh cap is what binds, and it
    /// still holds for the worst two-level perturbations.
    #[test]
    fn cap_binds_on_flat_attention_and_holds() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for delta in [0.01, 0.1, 0.5, 1.0, 3.0] {
            assert!((total_variation(delta, 1.0) - 2.0 * (delta / 2.0).tanh()).abs() < 1e-15);
            assert!(total_variation(delta, 1.0) < delta.exp_m1() * 2.0);
            for _ in 0..5000 {
                let n = rng.gen_range(2..16);
                let s: Vec<f64> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let sh: Vec<f64> = s.iter().map(|x| x + if rng.gen_bool(0.5) { delta } else { -delta }).collect();
                let tv = l1(&softmax(&s), &softmax(&sh));
                assert!(tv <= total_variation(delta, 1.0) * (1.0 + 1e-12) + 1e-15, "tv {tv} > cap (Δ {delta})");
            }
        }
    }

    #[test]
    fn limits() {
        assert_eq!(total_variation(0.3, 0.0), 0.0);
        assert_eq!(total_variation(0.0, 0.5), 0.0);
        assert!(total_variation(f64::INFINITY, 0.1).is_infinite());
        // Small Δ, α̂: ≈ 2 α̂ Δ.
        let t = total_variation(1e-3, 0.01);
        assert!((t / (2.0 * 0.01 * 1e-3) - 1.0).abs() < 0.01, "{t}");
    }
}
