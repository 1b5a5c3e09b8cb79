//! Applying plans: one batch per sequence (launches per tier pair, batched equals page by page),
//! safe order, stale views, positions after drops, tables, RDKV pages.

mod common;

use common::*;
use kvforge_control::runtime::{apply, ApplyReport, ControlError, PagedCache, PositionMap, Signal, SimCache, SimError};
use kvforge_control::*;
use kvforge_spec::{Spec, TierId, TAIL_TIER};
use proptest::prelude::*;

#[allow(non_snake_case)]
fn P() -> usize {
    spec("rdkv").page.tokens
}

fn sim(name: &str, heads: usize, tokens: usize) -> (SimCache, PositionMap) {
    let mut c = SimCache::new(spec(name), D, heads, 1);
    let seq = c.add_sequence();
    c.append(seq, tokens);
    let mut pos = PositionMap::new(seq, heads);
    pos.sync(&c).unwrap();
    (c, pos)
}

fn flat<C: PagedCache>(pos: &PositionMap, c: &C, name: &str) -> PageTableView {
    pos.view(c, costs(&spec(name), CostModel::Resident), |k, _| Signal { mass: 1.0 + k.first_token as f64, ..Default::default() }).unwrap()
}

fn plan_of(view: &PageTableView, ds: &[(usize, usize, u8)]) -> Plan {
    let mut decisions: Vec<Decision> = ds.iter().map(|&(head, index, to)| Decision { page: PageId { head, index }, from_tier: view.heads[head][index].tier, to_tier: to }).collect();
    decisions.sort_by_key(|d| d.page);
    let mut p = Plan { decisions, budget_bytes: 0.0, cost_before: view.cost(), cost_after: 0.0, distortion_before: 0.0, distortion_after: 0.0, lambda: 0.0, duality_gap: 0.0, feasible: true, forced: vec![] };
    p.cost_after = simulate(view, &p).cost();
    p.budget_bytes = free_limits(view).budget.bytes(view.context_tokens, view.heads.len());
    p
}

/// A budget nothing exceeds: the checker then only checks the moves themselves.
fn free_limits(view: &PageTableView) -> Limits {
    Limits { budget: Budget::Total(view.cost() * 2.0), protection: Protection::none() }
}

#[test]
fn one_batch_drops_first_then_one_launch_per_tier_pair() {
    let p = spec("rdkv").page.tokens;
    let (mut c, mut pos) = sim("rdkv", 2, 6 * p + 10);
    let v = flat(&pos, &c, "rdkv");
    let l = free_limits(&v);
    let plan = plan_of(&v, &[(0, 1, 5), (0, 3, 5), (0, 4, 2), (0, 2, 3), (1, 0, 4)]);
    let r = pos.apply(&mut c, &v, &plan, &l).unwrap();
    assert_eq!((r.dropped, r.retiered, r.launches, c.launches), (2, 3, 3, 3));
    // Drops first, then launches deepest source tier first (all tier 1 here), by target tier;
    // every index is the view's (before the batch).
    assert_eq!(c.log, vec![(0, 0, 1, 5), (0, 0, 3, 5), (0, 0, 4, 2), (0, 0, 2, 3), (0, 1, 0, 4)]);
    assert_eq!(c.page_tiers(0, 0).unwrap(), vec![(1, p), (3, p), (2, p), (1, p), (TAIL_TIER, 10)]);
    // Positions survive the drops.
    pos.sync(&c).unwrap();
    let v2 = flat(&pos, &c, "rdkv");
    let firsts: Vec<usize> = v2.heads[0].iter().map(|x| x.first_token).collect();
    assert_eq!(firsts, vec![0, 2 * p, 4 * p, 5 * p, 6 * p]);
    assert_eq!(v2.context_tokens, 6 * p + 10);
    // New pages continue after the last position, whatever was dropped.
    c.append(0, p - 4);
    pos.sync(&c).unwrap();
    let v3 = flat(&pos, &c, "rdkv");
    let firsts: Vec<usize> = v3.heads[0].iter().map(|x| x.first_token).collect();
    assert_eq!(firsts, vec![0, 2 * p, 4 * p, 5 * p, 6 * p, 7 * p]);
    assert_eq!(v3.heads[0].last().unwrap().tokens, 6);
}

#[test]
fn moves_of_two_kinds_cost_two_launches() {
    let (mut c, pos) = sim("rdkv", 4, 10 * P() + 3);
    let v = flat(&pos, &c, "rdkv");
    // 9 re-codes b16 → b8 or b16 → b2 over four heads, and 3 drops (no launch).
    let ds = [(0, 0, 2), (0, 3, 4), (0, 5, 5), (1, 1, 2), (1, 2, 2), (2, 9, 4), (2, 4, 5), (3, 0, 2), (3, 7, 4), (3, 8, 2), (3, 9, 5), (1, 6, 4)];
    let r = apply(&mut c, 0, &v, &plan_of(&v, &ds), &free_limits(&v)).unwrap();
    assert_eq!((r.dropped, r.retiered, r.launches, c.launches), (3, 9, 2, 2));
    // Page by page, the same plan costs one launch per re-code.
    let mut s = PageByPage(sim("rdkv", 4, 10 * P() + 3).0);
    let r = apply(&mut s, 0, &v, &plan_of(&v, &ds), &free_limits(&v)).unwrap();
    assert_eq!((r.launches, s.0.launches), (9, 9));
    assert!((0..4).all(|h| s.page_tiers(0, h) == c.page_tiers(0, h)));
    // An empty plan launches nothing.
    assert_eq!(c.retier_pages(0, &[]), Ok(0));
}

#[test]
fn deeper_moves_free_slots_first() {
    // Tier 2 (b8) is full: page 0 must leave it before page 1 can enter.
    let (mut c, mut pos) = sim("rdkv", 1, 2 * P());
    c.retier(0, 0, 0, 2).unwrap();
    c.log.clear();
    c.capacity = Some(vec![100, 100, 1, 100, 100, 0]);
    pos.sync(&c).unwrap();
    let v = flat(&pos, &c, "rdkv");
    let plan = plan_of(&v, &[(0, 0, 3), (0, 1, 2)]);
    apply(&mut c, 0, &v, &plan, &free_limits(&v)).unwrap();
    assert_eq!(c.log, vec![(0, 0, 0, 3), (0, 0, 1, 2)]);
}

#[test]
fn stale_views_and_bad_plans_touch_nothing() {
    let (mut c, pos) = sim("rdkv", 1, 4 * P());
    let v = flat(&pos, &c, "rdkv");
    let plan = plan_of(&v, &[(0, 1, 5)]);
    c.append(0, P());
    assert!(matches!(apply(&mut c, 0, &v, &plan, &free_limits(&v)), Err(ControlError::Stale { .. })));
    let bad = plan_of(&v, &[(0, 1, 1)]);
    assert!(matches!(apply(&mut c, 0, &v, &bad, &free_limits(&v)), Err(ControlError::Plan(Violation::NotDown { .. }))));
    assert!(c.log.is_empty());
}

#[test]
fn out_of_pages_rejects_the_whole_batch() {
    let (mut c, pos) = sim("rdkv", 1, 4 * P());
    c.capacity = Some(vec![100, 100, 100, 0, 100, 0]);
    let v = flat(&pos, &c, "rdkv");
    let before = c.page_tiers(0, 0).unwrap();
    let plan = plan_of(&v, &[(0, 0, 5), (0, 2, 3)]);
    match apply(&mut c, 0, &v, &plan, &free_limits(&v)) {
        Err(ControlError::Cache { total: 2, source }) => assert!(source.to_string().contains("out of pages for tier `b4`"), "{source}"),
        other => panic!("{other:?}"),
    }
    assert_eq!((c.page_tiers(0, 0).unwrap(), c.log.len(), c.launches), (before.clone(), 0, 0));
    // Bad moves are refused before anything changes, as by `KvCache::retier_pages`.
    for bad in [vec![(0, 1, 5), (0, 4, 2)], vec![(0, 1, 5), (0, 1, 3)], vec![(0, 0, 3), (0, 1, 1)], vec![(0, 1, 9)], vec![(1, 0, 2)]] {
        assert!(c.retier_pages(0, &bad).is_err(), "{bad:?}");
        assert_eq!((c.page_tiers(0, 0).unwrap(), c.log.len()), (before.clone(), 0));
    }
    assert!(c.retier_pages(1, &[]).is_err());
}

/// A `SimCache` behind the trait's default `retier_pages`: one `retier` per move.
struct PageByPage(SimCache);

impl PagedCache for PageByPage {
    type Error = SimError;
    fn spec(&self) -> &Spec {
        self.0.spec()
    }
    fn head_dim(&self) -> usize {
        self.0.head_dim()
    }
    fn num_kv_heads(&self) -> usize {
        self.0.num_kv_heads()
    }
    fn page_tiers(&self, seq: usize, head: usize) -> Result<Vec<(TierId, usize)>, SimError> {
        self.0.page_tiers(seq, head)
    }
    fn retier(&mut self, seq: usize, head: usize, index: usize, to: TierId) -> Result<(), SimError> {
        self.0.retier(seq, head, index, to)
    }
}

/// (kv heads, full pages per head, re-codes made before the view, per page `(moved?, to)`).
type Case = (usize, usize, Vec<(usize, usize, u8)>, Vec<(bool, u8)>);

/// Plans over a cache with some pages moved already (several source tiers): re-codes before
/// the view, then per page `(moved?, to)` picks, mapped onto the tiers below it.
fn arb_case() -> impl Strategy<Value = Case> {
    (1usize..4, 1usize..9).prop_flat_map(|(heads, full)| {
        let pages = heads * full;
        (Just(heads), Just(full), prop::collection::vec((0..heads, 0..full, 2u8..5), 0..6), prop::collection::vec((any::<bool>(), 0u8..8), pages))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// One batch (`SimCache::retier_pages`) equals page-by-page `retier` calls in the safe
    /// order (the trait's default) and the view's [`simulate`]: same tiers, same positions,
    /// drops mixed with re-codes, empty plans included; it takes one launch per tier pair.
    #[test]
    fn batched_equals_page_by_page(case in arb_case(), tail in 0usize..3) {
        let (heads, full, pre, picks) = case;
        let s = spec("rdkv");
        let p = s.page.tokens;
        let (mut c, mut pos) = sim("rdkv", heads, full * p + tail * 20);
        for (h, i, to) in pre {
            if c.page_tiers(0, h).unwrap()[i].0 < to {
                c.retier(0, h, i, to).unwrap();
            }
        }
        pos.sync(&c).unwrap();
        let v = flat(&pos, &c, "rdkv");
        let drop = s.tiers.len() as u8 - 1;
        let mut ds = Vec::new();
        for h in 0..heads {
            for i in 0..full {
                let (moved, k) = picks[h * full + i];
                let from = v.heads[h][i].tier;
                if moved {
                    ds.push((h, i, from + 1 + k % (drop - from)));
                }
            }
        }
        let plan = plan_of(&v, &ds);
        let mut seq = PageByPage(c.clone());
        let mut seq_pos = pos.clone();
        let l = free_limits(&v);
        (c.log, c.launches) = (Vec::new(), 0);
        let r: ApplyReport = pos.apply(&mut c, &v, &plan, &l).unwrap();
        let rs = seq_pos.apply(&mut seq, &v, &plan, &l).unwrap();
        let after = simulate(&v, &plan);
        pos.sync(&c).unwrap();
        seq_pos.sync(&seq).unwrap();
        prop_assert_eq!(&flat(&pos, &c, "rdkv").heads, &flat(&seq_pos, &seq, "rdkv").heads);
        for h in 0..heads {
            let want: Vec<(TierId, usize, usize)> = after.heads[h].iter().map(|x| (x.tier, x.tokens, x.first_token)).collect();
            let got: Vec<(TierId, usize, usize)> = flat(&pos, &c, "rdkv").heads[h].iter().map(|x| (x.tier, x.tokens, x.first_token)).collect();
            prop_assert_eq!(got, want);
        }
        let pairs: std::collections::BTreeSet<(TierId, TierId)> = plan.decisions.iter().filter(|d| d.to_tier != drop).map(|d| (d.from_tier, d.to_tier)).collect();
        prop_assert_eq!((r.launches, c.launches, r.dropped, r.retiered), (pairs.len(), pairs.len(), rs.dropped, rs.retiered));
        prop_assert_eq!(rs.launches, rs.retiered);
        prop_assert_eq!(c.log.len(), plan.decisions.len());
    }
}

#[test]
fn positions_catch_drops_behind_their_back() {
    let (mut c, mut pos) = sim("rdkv", 1, 4 * P());
    c.retier(0, 0, 1, 5).unwrap();
    assert!(matches!(pos.sync(&c), Err(ControlError::Positions(_))));
}

#[test]
fn importance_tracker_smooths_the_window_max() {
    let mut t = ImportanceTracker::new(0.5);
    let k = PageKey { head: 0, first_token: 64 };
    t.observe(k, 0.2);
    t.observe(k, 0.6);
    t.roll();
    assert_eq!(t.get(k), 0.6);
    t.roll();
    assert_eq!(t.get(k), 0.3);
    t.observe(k, 0.1);
    t.roll();
    assert!((t.get(k) - 0.2).abs() < 1e-12);
    t.retain(|_| false);
    assert_eq!(t.get(k), 0.0);
}

#[test]
fn default_tables_are_monotone_and_documented() {
    for name in ["baseline", "certified", "rdkv", "spherical"] {
        let s = spec(name);
        let t = DistortionTable::from_spec(&s);
        assert_eq!(t.eps.len(), s.tiers.len());
        assert!(t.eps[1..].windows(2).all(|w| w[0] <= w[1]), "{name}: {:?}", t.eps);
        if s.tiers.last().unwrap().is_drop() {
            assert_eq!(*t.eps.last().unwrap(), 1.0);
        }
        println!("{name:10} ε: {}", s.tiers.iter().zip(&t.eps).map(|(t, e)| format!("{}={e:.3e}", t.name)).collect::<Vec<_>>().join(" "));
    }
    let r = DistortionTable::from_spec(&spec("rdkv"));
    assert!((r.eps[4] - 3.0 / 9.0).abs() < 1e-12 && (r.eps[3] - 3.0 / 225.0).abs() < 1e-12);
    let s = spec("rdkv");
    assert!(DistortionTable::calibrated(&s, vec![0.0, 0.0, 1e-4, 1e-2, 0.2, 1.0]).is_ok());
    assert!(matches!(DistortionTable::calibrated(&s, vec![0.0, 0.0, 1e-2, 1e-4, 0.2, 1.0]), Err(distortion::TableError::NotMonotone { .. })));
    assert!(matches!(DistortionTable::calibrated(&s, vec![0.0; 3]), Err(distortion::TableError::Length { .. })));
    assert!(matches!(DistortionTable::calibrated(&s, vec![0.0, 0.0, f64::NAN, 1e-2, 0.2, 1.0]), Err(distortion::TableError::Value { .. })));
}

#[test]
fn rdkv_pages_per_head_budget_and_checker() {
    let s = spec("rdkv");
    assert!(matches!(RdkvController::new(&spec("spherical")), Err(rdkv::RdkvError::Spherical(_))));
    let mut c = RdkvController::new(&s).unwrap();
    assert_eq!(c.table.eps[1], 0.0);
    assert_eq!(*c.table.eps.last().unwrap(), 1.0);
    // Head 0 has concentrated attention, head 1 flat: per head, both get the same bytes.
    let v = view(&s, 2, 32, 1, 7, |h, i| {
        if h == 0 {
            if i % 8 == 0 {
                1.0
            } else {
                1e-5
            }
        } else {
            0.03
        }
    });
    let top = v.costs.cost(1, v.costs.page_tokens) / v.costs.page_tokens as f64;
    let mut prev = f64::INFINITY;
    for k in 3..=10 {
        let l = Limits { budget: Budget::PerToken(top * k as f64 / 10.0), protection: Protection::default() };
        let plan = c.decide(&v, &l);
        check_plan(&v, &plan, &l).unwrap();
        assert!(plan.feasible, "{k}");
        assert!(plan.distortion_after <= prev + 1e-12);
        prev = plan.distortion_after;
        let per_head: Vec<f64> = simulate(&v, &plan).heads.iter().map(|ps| ps.iter().map(|p| v.costs.cost(p.tier, p.tokens)).sum()).collect();
        assert!(per_head.iter().all(|&b| b <= plan.budget_bytes / 2.0 + 1e-9), "{k}: {per_head:?}");
    }
    // One knapsack over both heads moves bytes to the flat head.
    c.per_head = false;
    let l = Limits { budget: Budget::PerToken(top * 0.3), protection: Protection::default() };
    let joint = c.decide(&v, &l);
    check_plan(&v, &joint, &l).unwrap();
    c.per_head = true;
    let split = c.decide(&v, &l);
    assert!(joint.distortion_after <= split.distortion_after + 1e-12);
}

/// The view read head by head on the pool is the sequential view: pages, signals (token
/// masses included), pins and the normalisation over the sequence; and a stale map fails
/// both ways.
#[test]
fn parallel_view_equals_view() {
    let (mut c, mut pos) = sim("rdkv", 8, 40 * P() + 17);
    let seq = 0;
    c.retier(seq, 3, 2, 3).unwrap();
    let signal = |k: PageKey, len: usize| Signal {
        mass: (k.first_token as f64 * 0.37 + k.head as f64).sin().abs(),
        token_mass: (k.head % 2 == 0).then(|| (0..len).map(|t| 1.0 / (k.first_token + t + 1) as f64).collect()),
        pinned: k.first_token % (7 * P()) == 0,
    };
    let costs = costs(&spec("rdkv"), CostModel::Resident);
    let a = pos.view(&c, costs.clone(), signal).unwrap();
    let b = pos.view_par(&c, costs.clone(), signal).unwrap();
    assert_eq!(a, b);
    assert!(a.heads.iter().all(|h| h.len() == 41));
    c.append(seq, 3 * P());
    assert!(pos.view_par(&c, costs.clone(), signal).is_err() && pos.view(&c, costs.clone(), signal).is_err());
    pos.sync(&c).unwrap();
    assert_eq!(pos.view_par(&c, costs.clone(), signal).unwrap(), pos.view(&c, costs, signal).unwrap());
}

/// Several sequences' plans in one batch: the tables end as applying each plan alone leaves
/// them, the launches are shared per tier pair, and a stale plan fails only its sequence.
#[test]
fn plans_of_several_sequences_land_in_one_batch() {
    use kvforge_control::runtime::{apply_grown, apply_grown_many, CheckedPlan};
    let p = P();
    let mut c = SimCache::new(spec("rdkv"), D, 2, 1);
    let seqs: Vec<usize> = (0..3).map(|_| c.add_sequence()).collect();
    let mut checked = Vec::new();
    for &s in &seqs {
        c.append(s, 6 * p + 5);
        let mut pos = PositionMap::new(s, 2);
        pos.sync(&c).unwrap();
        let v = flat(&pos, &c, "rdkv");
        // Every sequence: a drop, two b16 → b8 and one b16 → b4 (all from tier 1).
        let plan = plan_of(&v, &[(0, 1, 5), (0, 2, 2), (1, 3, 2), (1, 0, 3)]);
        checked.push(CheckedPlan::new(v.clone(), plan, &free_limits(&v)).unwrap().read_at(c.layout_epoch(s)));
    }
    let mut alone = c.clone();
    // Tokens arrive between the snapshot and the apply (grown plans).
    for &s in &seqs {
        c.append(s, p + 1);
        alone.append(s, p + 1);
    }
    // Sequence 1's table changes behind its plan's back: its plan is stale.
    c.retier(1, 0, 4, 4).unwrap();
    alone.retier(1, 0, 4, 4).unwrap();
    let (l0, l2) = (c.launches, alone.launches);
    let due: Vec<(usize, &CheckedPlan)> = seqs.iter().zip(&checked).map(|(&s, x)| (s, x)).collect();
    let out = apply_grown_many(&mut c, &due).unwrap();
    assert!(matches!(out[1], Err(ControlError::Stale { seq: 1, .. })), "{:?}", out[1]);
    for i in [0, 2] {
        let r = out[i].as_ref().unwrap();
        assert_eq!((r.dropped, r.retiered, r.launches), (1, 3, 2));
        apply_grown(&mut alone, seqs[i], &checked[i]).unwrap();
    }
    // Two launches (1 → 2 and 1 → 3) for both sequences together; four alone.
    assert_eq!((c.launches - l0, alone.launches - l2), (2, 4));
    for &s in &seqs {
        for h in 0..2 {
            assert_eq!(c.page_tiers(s, h).unwrap(), alone.page_tiers(s, h).unwrap(), "sequence {s} head {h}");
        }
    }
}
