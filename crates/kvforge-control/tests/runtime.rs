//! Applying plans: safe order, stale views, positions after drops, tables, RDKV pages.

mod common;

use common::*;
use kvforge_control::runtime::{apply, ControlError, PagedCache, PositionMap, Signal, SimCache};
use kvforge_control::*;
use kvforge_spec::TAIL_TIER;

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

fn flat(pos: &PositionMap, c: &SimCache, name: &str) -> PageTableView {
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
fn drops_go_highest_index_first_and_moves_use_shifted_indices() {
    let p = spec("rdkv").page.tokens;
    let (mut c, mut pos) = sim("rdkv", 2, 6 * p + 10);
    let v = flat(&pos, &c, "rdkv");
    let l = free_limits(&v);
    let plan = plan_of(&v, &[(0, 1, 5), (0, 3, 5), (0, 4, 2), (0, 2, 3), (1, 0, 4)]);
    let r = pos.apply(&mut c, &v, &plan, &l).unwrap();
    assert_eq!((r.dropped, r.retiered), (2, 3));
    // Drops from the top, then the deepest source tier first (all tier 1 here), by page.
    assert_eq!(c.log, vec![(0, 0, 3, 5), (0, 0, 1, 5), (0, 0, 1, 3), (0, 0, 2, 2), (0, 1, 0, 4)]);
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
fn cache_failure_reports_progress() {
    let (mut c, pos) = sim("rdkv", 1, 4 * P());
    c.capacity = Some(vec![100, 100, 100, 0, 100, 0]);
    let v = flat(&pos, &c, "rdkv");
    let plan = plan_of(&v, &[(0, 0, 5), (0, 2, 3)]);
    match apply(&mut c, 0, &v, &plan, &free_limits(&v)) {
        Err(ControlError::Cache { applied: 1, total: 2, .. }) => {}
        other => panic!("{other:?}"),
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
    let v = view(&s, 2, 32, 1, 7, |h, i| if h == 0 { if i % 8 == 0 { 1.0 } else { 1e-5 } } else { 0.03 });
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
