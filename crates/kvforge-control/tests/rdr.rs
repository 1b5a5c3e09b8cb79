//! RDR on synthetic views and multi-step simulated decodes.

mod common;

use common::*;
use kvforge_control::*;
use kvforge_spec::TAIL_TIER;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn random_view(spec_name: &str, heads: usize, full: usize, tail: usize, seed: u64, pinned: f64) -> PageTableView {
    let spec = spec(spec_name);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let masses: Vec<f64> = (0..heads * (full + 1)).map(|_| heavy_tailed(&mut rng)).collect();
    let mut v = view(&spec, heads, full, 1, tail, |h, i| masses[h * (full + 1) + i]);
    for p in v.heads.iter_mut().flatten() {
        p.pinned = rng.gen_bool(pinned);
    }
    v
}

fn limits(per_token: f64) -> Limits {
    Limits { budget: Budget::PerToken(per_token), protection: Protection::default() }
}

/// Bytes per token per head of the first ladder tier (where pages are born).
fn top_cost(v: &PageTableView) -> f64 {
    v.costs.cost(1, v.costs.page_tokens) / v.costs.page_tokens as f64
}

fn specs() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("rdkv"), Just("spherical"), Just("certified")]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Every step of a simulated decode: the plan passes the checker, the cache holds exactly
    /// the planned bytes, and they fit the budget whenever protection allows.
    #[test]
    fn budget_never_exceeded_on_any_step(name in specs(), heads in 1usize..4, seed in any::<u64>(), frac in 0.05f64..1.2, prefill in 0usize..1500, policy in 0u8..3, cooldown in 0usize..64) {
        let spec = spec(name);
        let pt = spec.page.tokens;
        let top = costs(&spec, CostModel::Resident).cost(1, pt) / pt as f64;
        let d = Driver { spec, heads, limits: limits(top * frac), seed, prefill, steps: 400, noise: 0.3, pinned_every: Some(7) };
        let mut rdr = rdr(name);
        rdr.every = 8;
        rdr.cooldown = cooldown;
        rdr.drop_policy = [DropPolicy::Joint, DropPolicy::Penalty(1.0), DropPolicy::LastResort][policy as usize];
        let t = d.run(&mut rdr);
        prop_assert!(!t.plans.is_empty());
        // Infeasible only while protected pages + tail alone exceed the budget.
        for (_, plan, view) in &t.plans {
            if !plan.feasible {
                let floor: f64 = view.iter().map(|(_, p)| {
                    d.limits.protection.allowed(p, view.context_tokens, &view.costs).iter().map(|&x| view.costs.cost(x, p.tokens)).fold(f64::INFINITY, f64::min)
                }).sum();
                prop_assert!(floor > plan.budget_bytes);
            }
        }
    }

    /// Predicted distortion never rises when the budget does.
    #[test]
    fn distortion_monotone_in_budget(name in specs(), heads in 1usize..5, full in 1usize..40, seed in any::<u64>(), policy in 0u8..3) {
        let v = random_view(name, heads, full, 10, seed, 0.1);
        let top = top_cost(&v);
        let mut prev = f64::INFINITY;
        for k in 0..=12 {
            let mut rdr = rdr(name);
            rdr.drop_policy = [DropPolicy::Joint, DropPolicy::Penalty(1.0), DropPolicy::LastResort][policy as usize];
            let l = limits(top * k as f64 / 10.0);
            let plan = rdr.decide(&v, &l);
            check_plan(&v, &plan, &l).unwrap();
            prop_assert!(plan.distortion_after <= prev + 1e-12, "budget {k}/10: {} after {prev}", plan.distortion_after);
            prev = plan.distortion_after;
        }
    }

    /// Sinks, recent window and pinned pages: never dropped, never below the floor, at any
    /// budget (zero included).
    #[test]
    fn protected_pages_never_dropped(name in specs(), heads in 1usize..4, full in 1usize..30, seed in any::<u64>(), frac in 0.0f64..1.0, floor in 1u8..4, sink in 0usize..100, recent in 0usize..300) {
        let v = random_view(name, heads, full, 5, seed, 0.2);
        let l = Limits { budget: Budget::PerToken(top_cost(&v) * frac), protection: Protection { sink_tokens: sink, recent_tokens: recent, floor } };
        let plan = rdr(name).decide(&v, &l);
        check_plan(&v, &plan, &l).unwrap();
        let last_live = v.costs.lowest_live();
        for (id, p) in v.iter() {
            let t = plan.tier_of(id, &v).unwrap();
            if l.protection.protects(p, v.context_tokens) {
                prop_assert!(!v.costs.tiers[t as usize].drop, "protected page {id:?} dropped");
                prop_assert!(t <= floor.min(last_live).max(p.tier), "protected page {id:?} at {t} below floor {floor}");
            }
            if p.tier == TAIL_TIER {
                prop_assert_eq!(t, TAIL_TIER);
            }
        }
    }

    /// Tier flips per page: monotone down the ladder, at most ladder length − 1 of them, and a
    /// page moves again within its cooldown only when the plan says the budget forced it.
    #[test]
    fn hysteresis_bounds_flips(name in specs(), seed in any::<u64>(), frac in 0.1f64..0.9, cooldown in 0usize..100, noise in 0.0f64..1.0) {
        let spec = spec(name);
        let pt = spec.page.tokens;
        let top = costs(&spec, CostModel::Resident).cost(1, pt) / pt as f64;
        let d = Driver { spec: spec.clone(), heads: 2, limits: limits(top * frac), seed, prefill: 1024, steps: 600, noise, pinned_every: None };
        let mut rdr = rdr(name);
        rdr.every = 4;
        rdr.cooldown = cooldown;
        let t = d.run(&mut rdr);
        let ladder = spec.ladder().len();
        for (key, hist) in &t.tiers {
            // A tail page becomes a full page under the same key: that is not a flip.
            let hist: Vec<_> = hist.iter().copied().filter(|x| x.1 != TAIL_TIER).collect();
            let flips = hist.windows(2).filter(|w| w[0].1 != w[1].1).count();
            prop_assert!(hist.windows(2).all(|w| w[0].1 <= w[1].1), "{key:?}: tiers go up: {hist:?}");
            prop_assert!(flips < ladder, "{key:?}: {flips} flips on a ladder of {ladder}");
        }
        // Moves within the cooldown must be forced.
        let mut last_move: std::collections::HashMap<PageKey, u64> = Default::default();
        for (step, plan, view) in &t.plans {
            for dcs in &plan.decisions {
                let key = view.page(dcs.page).unwrap().key(dcs.page.head);
                if let Some(&at) = last_move.get(&key) {
                    if step - at < cooldown as u64 {
                        prop_assert!(plan.forced.contains(&dcs.page), "{key:?} moved at {at} and again at {step} unforced");
                    }
                }
                last_move.insert(key, *step);
            }
        }
    }
}

#[test]
fn forced_moves_override_cooldown_only_when_needed() {
    let s = spec("rdkv");
    let v = view(&s, 1, 8, 1, 0, |_, i| 1.0 + i as f64);
    let l = Limits { budget: Budget::PerToken(0.0), protection: Protection::none() };
    let mut rdr = rdr("rdkv");
    rdr.cooldown = 1000;
    rdr.drop_policy = DropPolicy::Joint;
    let top = top_cost(&v);
    // Step 1: a mild budget moves some pages.
    let plan = rdr.decide(&v, &Limits { budget: Budget::PerToken(top * 0.7), ..l });
    assert!(!plan.decisions.is_empty() && plan.forced.is_empty());
    let v2 = simulate(&v, &plan);
    // Step 2: slightly tighter, feasible without the frozen pages: nothing forced.
    let plan2 = rdr.decide(&v2, &Limits { budget: Budget::PerToken(top * 0.6), ..l });
    assert!(plan2.feasible && plan2.forced.is_empty(), "{plan2:?}");
    let v3 = simulate(&v2, &plan2);
    // Step 3: only possible by moving frozen pages again.
    let plan3 = rdr.decide(&v3, &Limits { budget: Budget::PerToken(top * 0.05), ..l });
    assert!(plan3.feasible && !plan3.forced.is_empty(), "{plan3:?}");
    check_plan(&v3, &plan3, &Limits { budget: Budget::PerToken(top * 0.05), ..l }).unwrap();
}

#[test]
fn score_margin_keeps_the_ranking_under_small_fluctuations() {
    let s = spec("rdkv");
    let l = |b| Limits { budget: Budget::PerToken(b), protection: Protection::none() };
    // Two pages of nearly equal importance; the controller first sees A lighter than B.
    let mk = |a: f64, b: f64| view(&s, 1, 2, 1, 0, move |_, i| if i == 0 { a } else { b });
    let (v1, v2) = (mk(1.0, 1.05), mk(1.05, 1.0));
    let top = top_cost(&v1);
    for (margin, lighter) in [(0.1, 0), (0.0, 1)] {
        let mut rdr = rdr("rdkv");
        rdr.drop_policy = DropPolicy::Joint;
        rdr.margin = margin;
        assert!(rdr.decide(&v1, &l(top)).decisions.is_empty(), "no pressure yet");
        // The signal swaps by 5% and one page must move: with the margin the ranking of the
        // first observation holds (A moves); without it, B is now the lighter one.
        let p = rdr.decide(&v2, &l(top * 0.9));
        assert_eq!(p.decisions.len(), 1);
        assert_eq!(p.decisions[0].page.index, lighter, "margin {margin}: {:?}", p.decisions);
    }
    // A change beyond the margin is followed.
    let mut rdr = rdr("rdkv");
    rdr.decide(&v1, &l(top));
    let p = rdr.decide(&mk(1.5, 1.0), &l(top * 0.9));
    assert_eq!(p.decisions[0].page.index, 1);
}

#[test]
fn last_resort_drops_only_when_nothing_can_be_down_tiered() {
    for seed in 0..50 {
        let v = random_view("rdkv", 2, 20, 3, seed, 0.0);
        let l = Limits { budget: Budget::PerToken(top_cost(&v) * (0.05 + 0.02 * seed as f64)), protection: Protection::none() };
        let mut rdr = rdr("rdkv");
        rdr.drop_policy = DropPolicy::LastResort;
        let plan = rdr.decide(&v, &l);
        let drop = v.costs.drop_tier().unwrap();
        if plan.decisions.iter().any(|d| d.to_tier == drop) {
            let low = v.costs.lowest_live();
            for (id, _) in v.iter().filter(|(_, p)| p.movable(v.costs.page_tokens)) {
                let t = plan.tier_of(id, &v).unwrap();
                assert!(t >= low, "seed {seed}: a page is dropped while {id:?} stays at tier {t}");
            }
        }
    }
}

#[test]
fn heavy_hitters_keep_the_best_tiers() {
    let s = spec("rdkv");
    let v = view(&s, 1, 32, 1, 0, |_, i| if i % 8 == 5 { 1.0 } else { 1e-4 });
    let l = Limits { budget: Budget::PerToken(top_cost(&v) * 0.1), protection: Protection::none() };
    for policy in [DropPolicy::Joint, DropPolicy::Penalty(1.0), DropPolicy::LastResort] {
        let mut rdr = rdr("rdkv");
        rdr.drop_policy = policy;
        let plan = rdr.decide(&v, &l);
        assert!(plan.feasible);
        let tier = |i| plan.tier_of(PageId { head: 0, index: i }, &v).unwrap();
        let worst_heavy = (5..32).step_by(8).map(tier).max().unwrap();
        let best_light = (0..32).filter(|i| i % 8 != 5).map(tier).min().unwrap();
        assert!(worst_heavy <= best_light, "{policy:?}: heavy pages at {worst_heavy}, light at {best_light}");
        if policy == DropPolicy::Joint {
            assert!(worst_heavy <= 2, "pure RD keeps heavy hitters at b16 or the near-lossless b8");
            assert!((0..32).any(|i| tier(i) == v.costs.drop_tier().unwrap()), "pure RD drops light pages");
        }
    }
}

#[test]
fn checker_rejects_bad_plans() {
    let s = spec("rdkv");
    let v = view(&s, 1, 6, 2, 20, |_, i| i as f64 + 1.0);
    let l = Limits { budget: Budget::PerToken(1e9), protection: Protection { sink_tokens: 4, recent_tokens: s.page.tokens, floor: 2 } };
    let base = rdr("rdkv").decide(&v, &l);
    assert!(base.decisions.is_empty());
    let with = |ds: Vec<Decision>| {
        let mut p = base.clone();
        p.decisions = ds;
        if p.decisions.iter().all(|d| v.costs.contains(d.to_tier)) {
            p.cost_after = simulate(&v, &p).cost();
        }
        p
    };
    let dec = |i, from, to| Decision { page: PageId { head: 0, index: i }, from_tier: from, to_tier: to };
    assert!(matches!(check_plan(&v, &with(vec![dec(2, 2, 1)]), &l), Err(Violation::NotDown { .. })));
    assert!(matches!(check_plan(&v, &with(vec![dec(0, 2, 5)]), &l), Err(Violation::Protected { .. })), "sink page dropped");
    assert!(matches!(check_plan(&v, &with(vec![dec(0, 2, 3)]), &l), Err(Violation::Protected { .. })), "sink page below floor");
    assert!(matches!(check_plan(&v, &with(vec![dec(5, 2, 5)]), &l), Err(Violation::Protected { .. })), "recent page dropped");
    assert!(matches!(check_plan(&v, &with(vec![dec(6, 0, 5)]), &l), Err(Violation::Immovable(_))), "tail page");
    assert!(matches!(check_plan(&v, &with(vec![dec(9, 2, 5)]), &l), Err(Violation::NoSuchPage(_))));
    assert!(matches!(check_plan(&v, &with(vec![dec(2, 2, 9)]), &l), Err(Violation::UnknownTier { .. })));
    assert!(matches!(check_plan(&v, &with(vec![dec(2, 1, 3)]), &l), Err(Violation::StaleFrom { .. })));
    assert!(matches!(check_plan(&v, &with(vec![dec(2, 2, 3), dec(2, 2, 4)]), &l), Err(Violation::Duplicate(_))));
    assert!(check_plan(&v, &with(vec![dec(2, 2, 5), dec(3, 2, 3)]), &l).is_ok());
    let tight = Limits { budget: Budget::PerToken(10.0), ..l };
    let mut p = with(vec![dec(2, 2, 3)]);
    p.budget_bytes = tight.budget.bytes(v.context_tokens, 1);
    assert!(matches!(check_plan(&v, &p, &tight), Err(Violation::OverBudget { .. })), "cheaper tiers were allowed");
    let mut p = with(vec![dec(1, 2, 5), dec(2, 2, 5), dec(3, 2, 5), dec(4, 2, 5)]);
    p.budget_bytes = tight.budget.bytes(v.context_tokens, 1);
    assert!(check_plan(&v, &p, &tight).is_ok(), "over budget is fine when only protected pages remain");
}

#[test]
fn one_decision_on_512_pages_by_8_heads() {
    let s = spec("rdkv");
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let masses: Vec<f64> = (0..8 * 513).map(|_| heavy_tailed(&mut rng)).collect();
    let v = view(&s, 8, 512, 1, 17, |h, i| masses[h * 513 + i]);
    let l = limits(top_cost(&v) * 0.3);
    for (name, policy) in [("penalty", DropPolicy::Penalty(1.0)), ("joint", DropPolicy::Joint), ("last-resort", DropPolicy::LastResort)] {
        let mut rdr = rdr("rdkv");
        rdr.drop_policy = policy;
        let t = std::time::Instant::now();
        let plan = rdr.decide(&v, &l);
        let el = t.elapsed();
        check_plan(&v, &plan, &l).unwrap();
        let drop = v.costs.drop_tier().unwrap();
        println!(
            "RDR {name:11} 512 pages x 8 heads: {:>8.2} ms ({} build), {} moves ({} drops), cost {:.0}/{:.0} B, predicted D {:.4} -> {:.4}, lambda {:.3e}, gap {:.2e}",
            el.as_secs_f64() * 1e3,
            if cfg!(debug_assertions) { "debug" } else { "release" },
            plan.decisions.len(),
            plan.decisions.iter().filter(|d| d.to_tier == drop).count(),
            plan.cost_after,
            plan.budget_bytes,
            plan.distortion_before,
            plan.distortion_after,
            plan.lambda,
            plan.duality_gap
        );
    }
}

/// One decode step in `sample` is tracked, the step of every decision among them, also when
/// `sample` does not divide the period or exceeds it.
#[test]
fn tracked_steps_are_one_in_sample_and_include_every_decision() {
    for (every, sample, per_period) in [(64, 8, 8), (64, 1, 64), (16, 5, 4), (4, 64, 1)] {
        let mut rdr = RdrController::new(&spec("rdkv"));
        rdr.every = every;
        rdr.sample = sample;
        let mut tracked = 0;
        for period in 0..3 {
            for _ in 0..every {
                let tracks = rdr.tracks();
                tracked += usize::from(tracks);
                if rdr.step() {
                    assert!(tracks, "every {every} sample {sample}: the decision at step {} is not tracked", rdr.steps());
                }
            }
            assert_eq!(tracked, (period + 1) * per_period, "every {every} sample {sample}");
        }
    }
}
