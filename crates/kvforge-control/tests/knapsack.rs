//! The knapsack solver against brute force, and the RDKV allocation built on it.

use kvforge_control::knapsack::{brute_force, solve, Choice};
use kvforge_control::rdkv::{allocate, allocate_head, channel_order, channel_weights, mixed_key_distortion, token_weights, RdkvController, EPS_K_LLAMA31_8B, EPS_V_LLAMA31_8B};
use proptest::prelude::*;

fn instance() -> impl Strategy<Value = (Vec<Vec<Choice>>, f64)> {
    let choice = (0u32..20, 0.0f64..10.0).prop_map(|(c, d)| Choice::new(c as f64, d));
    let item = prop::collection::vec(choice, 1..=5);
    (prop::collection::vec(item, 1..=6), 0.0f64..1.0).prop_map(|(items, f)| {
        let max: f64 = items.iter().map(|i| i.iter().map(|c| c.cost).fold(0.0, f64::max)).sum();
        let budget = (f * max * 1.1).floor();
        (items, budget)
    })
}

/// Largest distortion spread of one item: the Lagrangian heuristic is within one item of the
/// LP relaxation, hence of the optimum.
fn max_spread(items: &[Vec<Choice>]) -> f64 {
    items.iter().map(|i| i.iter().map(|c| c.dist).fold(0.0, f64::max) - i.iter().map(|c| c.dist).fold(f64::INFINITY, f64::min)).fold(0.0, f64::max)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Exact optimum or within the reported duality gap, and the gap is a valid certificate.
    #[test]
    fn optimal_within_reported_gap((items, budget) in instance()) {
        let s = solve(&items, budget);
        match brute_force(&items, budget) {
            None => prop_assert!(!s.feasible, "brute force finds nothing feasible, solver claims {s:?}"),
            Some((_, opt)) => {
                prop_assert!(s.feasible);
                prop_assert!(s.cost <= budget, "cost {} over budget {budget}", s.cost);
                prop_assert!(s.dual <= opt + 1e-9, "dual {} above the optimum {opt}", s.dual);
                prop_assert!(s.dist >= opt - 1e-9);
                prop_assert!(s.dist - opt <= s.gap + 1e-9, "dist {} optimum {opt} gap {}", s.dist, s.gap);
                prop_assert!(s.gap <= max_spread(&items) + 1e-9, "gap {} larger than one item's spread", s.gap);
                let (c, d) = items.iter().zip(&s.pick).fold((0.0, 0.0), |(c, d), (i, &p)| (c + i[p].cost, d + i[p].dist));
                prop_assert_eq!((c, d), (s.cost, s.dist));
            }
        }
    }

    /// More budget never means more distortion (the greedy path is budget-independent).
    #[test]
    fn distortion_monotone_in_budget((items, _) in instance(), budgets in prop::collection::vec(0u32..120, 2..8)) {
        let mut b = budgets;
        b.sort();
        let mut prev: Option<f64> = None;
        for budget in b {
            let s = solve(&items, budget as f64);
            if !s.feasible {
                continue;
            }
            if let Some(p) = prev {
                prop_assert!(s.dist <= p + 1e-12, "budget {budget}: {} after {p}", s.dist);
            }
            prev = Some(s.dist);
        }
    }

    /// Hundreds of items whose prices span orders of magnitude (page importances do): the
    /// solution meets the budget, the dual bound holds and more budget never adds distortion
    /// (one greedy path); the flat entry point gives the same answer.
    #[test]
    fn large_skewed_instances_stop_at_the_budget(
        items in prop::collection::vec(prop::collection::vec((1u32..400, -12.0f64..12.0).prop_map(|(c, d)| Choice::new(c as f64, d.exp())), 1..=5), 50..400),
        fracs in prop::collection::vec(0.0f64..1.0, 2..5),
    ) {
        let max: f64 = items.iter().map(|i| i.iter().map(|c| c.cost).fold(0.0, f64::max)).sum();
        let min: f64 = items.iter().map(|i| i.iter().map(|c| c.cost).fold(f64::INFINITY, f64::min)).sum();
        let mut fracs = fracs;
        fracs.sort_by(f64::total_cmp);
        let mut prev: Option<f64> = None;
        for f in fracs {
            let budget = (min + f * (max - min)).floor();
            let s = solve(&items, budget);
            prop_assert_eq!(s.feasible, min <= budget);
            if !s.feasible {
                continue;
            }
            prop_assert!(s.cost <= budget);
            prop_assert!(s.dual <= s.dist + 1e-9 * s.dist.abs().max(1.0));
            if let Some(p) = prev {
                prop_assert!(s.dist <= p + 1e-9 * p.abs().max(1.0), "budget {budget}: {} after {p}", s.dist);
            }
            prev = Some(s.dist);
            let mut start = vec![0];
            for it in &items {
                start.push(start.last().unwrap() + it.len());
            }
            let flat: Vec<Choice> = items.iter().flatten().copied().collect();
            prop_assert_eq!(kvforge_control::knapsack::solve_flat(&flat, &start, budget), s);
        }
    }

    /// Seed 002 Alg. 2 on the paper's table: bits vs brute force, heavier units never get
    /// fewer bits.
    #[test]
    fn rdkv_allocate_vs_brute_force(w in prop::collection::vec(0.0f64..1.0, 1..=6), avg in 0.0f64..16.0) {
        let budget = (avg * w.len() as f64).floor();
        let a = allocate(&w, &EPS_V_LLAMA31_8B, 1.0, budget);
        let items: Vec<Vec<Choice>> = w.iter().map(|&x| EPS_V_LLAMA31_8B.iter().map(|&(b, e)| Choice::new(b as f64, x * e)).collect()).collect();
        let (_, opt) = brute_force(&items, budget).unwrap();
        prop_assert!(a.feasible && a.cost <= budget);
        prop_assert!(a.distortion - opt <= a.duality_gap + 1e-9);
        prop_assert!(a.distortion >= opt - 1e-9);
        for i in 0..w.len() {
            for j in 0..w.len() {
                if w[i] > w[j] {
                    prop_assert!(a.bits[i] >= a.bits[j], "w {} > {} but bits {} < {}", w[i], w[j], a.bits[i], a.bits[j]);
                }
            }
        }
    }
}

#[test]
fn exact_on_most_small_instances() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (mut exact, mut n, mut worst) = (0, 0, 0.0f64);
    for _ in 0..2000 {
        let items: Vec<Vec<Choice>> = (0..rng.gen_range(2..=6)).map(|_| (0..rng.gen_range(2..=5)).map(|_| Choice::new(rng.gen_range(0..20) as f64, rng.gen_range(0.0..10.0))).collect()).collect();
        let budget = rng.gen_range(0.0..60.0f64).floor();
        let Some((_, opt)) = brute_force(&items, budget) else { continue };
        let s = solve(&items, budget);
        n += 1;
        if s.dist - opt <= 1e-9 {
            exact += 1;
        }
        worst = worst.max((s.dist - opt) / opt.max(1e-9));
    }
    println!("knapsack: exact optimum on {exact}/{n} feasible random instances; worst relative excess {worst:.3}");
    assert!(exact * 10 >= n * 6, "only {exact}/{n} exact");
}

#[test]
fn uniform_weights_get_uniform_bits() {
    let w = vec![0.5; 64];
    for b in [2u32, 4, 8, 16] {
        let a = allocate(&w, &EPS_K_LLAMA31_8B, 1.0, (b * 64) as f64);
        assert!(a.bits.iter().all(|&x| x == b), "{b}: {:?}", a.bits);
        assert_eq!(a.duality_gap, 0.0);
    }
}

#[test]
fn water_filling_evicts_light_units_first() {
    // Theorem 3.3: the budget decides eviction and quantisation on one curve.
    let w: Vec<f64> = (0..32).map(|i| 2f64.powi(-i / 2)).collect();
    let tight = allocate(&w, &EPS_V_LLAMA31_8B, 1.0, 32.0 * 2.0);
    let loose = allocate(&w, &EPS_V_LLAMA31_8B, 1.0, 32.0 * 8.0);
    assert!(tight.bits.iter().filter(|&&b| b == 0).count() > loose.bits.iter().filter(|&&b| b == 0).count());
    assert!(tight.bits.windows(2).all(|p| p[0] >= p[1]), "{:?}", tight.bits);
    assert!(loose.distortion < tight.distortion);
    assert!(tight.lambda > loose.lambda);
}

#[test]
fn head_allocation_spends_k_budget_on_kept_tokens_only() {
    let t = 256;
    let d = 128;
    let tw: Vec<f64> = (0..t).map(|i| if i % 16 == 0 { 1.0 } else { 0.001 * (i % 7) as f64 }).collect();
    let cw: Vec<f64> = (0..d).map(|c| 1.0 + (c % 5) as f64).collect();
    let budget = (2 * 32 * d * 16) as f64; // 32 fp16-equivalent tokens
    let h = allocate_head(&tw, &cw, &EPS_V_LLAMA31_8B, &EPS_K_LLAMA31_8B, budget, d);
    assert!(h.v.cost <= budget / 2.0);
    assert_eq!(h.kept.len(), h.v.bits.iter().filter(|&&b| b > 0).count());
    assert!(h.k.cost <= budget / 2.0);
    let k_bits: u32 = h.k.bits.iter().sum();
    assert_eq!(h.k.cost, k_bits as f64 * h.kept.len() as f64);
    assert!(h.kept.iter().filter(|&&i| i % 16 == 0).count() == t / 16, "heavy tokens are kept");
}

#[test]
fn weights_match_the_paper() {
    // attn: 2 queries over 3 tokens.
    let a = [0.5, 0.25, 0.25, 0.1, 0.1, 0.8];
    assert_eq!(token_weights(&a, 3, 1), vec![0.6, 0.35, 1.05]);
    let pooled = token_weights(&a, 3, 3);
    assert!((pooled[1] - 2.0 / 3.0).abs() < 1e-12 && (pooled[0] - 0.475).abs() < 1e-12);
    let q = [1.0, 0.0, 2.0, 0.0];
    let k = [3.0, 1.0, 4.0, 0.0];
    let w = channel_weights(&q, &k, 2);
    assert!((w[0] - 5f64.sqrt() * 5.0 / 2f64.sqrt()).abs() < 1e-12 && w[1] == 0.0);
}

/// Every permutation of 0..n (Heap's algorithm).
fn permutations(n: usize) -> Vec<Vec<u16>> {
    fn go(k: usize, a: &mut Vec<u16>, out: &mut Vec<Vec<u16>>) {
        if k <= 1 {
            out.push(a.clone());
            return;
        }
        for i in 0..k {
            go(k - 1, a, out);
            let j = if k % 2 == 0 { i } else { 0 };
            a.swap(j, k - 1);
        }
    }
    let mut out = Vec::new();
    go(n, &mut (0..n as u16).collect(), &mut out);
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The channel order (heaviest first) is the best assignment of channels to a mixed key's
    /// segments: brute force over all 8! orders of 8 channels (one channel per eighth).
    #[test]
    fn channel_order_minimises_mixed_key_distortion(w in prop::collection::vec(0.0f64..1.0, 8), e in prop::collection::vec(0u32..3, 4)) {
        let segs: Vec<kvforge_spec::ChannelSegment> = [16, 8, 4, 2].iter().zip(&e).filter(|(_, &n)| n > 0).map(|(&bits, &eighths)| kvforge_spec::ChannelSegment { bits, eighths }).collect();
        prop_assume!(segs.iter().map(|s| s.eighths).sum::<u32>() <= 8);
        let best = mixed_key_distortion(&segs, 8, &w, &channel_order(&w), &EPS_K_LLAMA31_8B).unwrap();
        for p in permutations(8) {
            let d = mixed_key_distortion(&segs, 8, &w, &p, &EPS_K_LLAMA31_8B).unwrap();
            prop_assert!(best <= d + 1e-12, "order {:?}: {} < {}", p, d, best);
        }
    }
}

#[test]
fn channel_order_is_heaviest_first_and_stable() {
    assert_eq!(channel_order(&[0.1, 0.5, 0.5, 0.0, 0.9]), vec![4, 1, 2, 0, 3]);
}

#[test]
fn rdkv_drives_the_trizone_spec() {
    let spec = kvforge_spec::Spec::load(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/trizone.toml"))).unwrap();
    let c = RdkvController::new(&spec).unwrap();
    // ε_K of the shared histogram: 2/8·ε(8) + 3/8·ε(4) + 1/8·ε(2) + 1/8·ε(0) (ε(16) = 0).
    let ek = 2.0 / 8.0 * 2.2e-5 + 3.0 / 8.0 * 0.0062 + 1.0 / 8.0 * 0.149 + 1.0 / 8.0;
    for (name, ev) in [("zb", 0.0), ("za8", 4.9e-5), ("za4", 0.0140), ("za2", 0.313)] {
        let id = spec.tier(name).unwrap().id as usize;
        assert!((c.table.eps[id] - 0.5 * (ek + ev)).abs() < 1e-12, "{name}: {}", c.table.eps[id]);
    }
}
