//! End to end on the CPU: synthetic attention with planted heavy hitters and needles, pages
//! coded byte-exactly by kvforge-ref, tiers chosen by the controllers, attention output error
//! against exact f64 attention on the original keys and values.
//!
//! A page re-tiered from the first ladder tier is coded as the GPU does it: the first-tier
//! page is decoded and the result re-encoded in the new tier (transcode), so spherical errors
//! compound like they will on the device. The world (synthetic heads, coded pages, split-K
//! partials of the test queries) is `kvforge_lab::frontier::World`, which `kvforge
//! frontier` sweeps over budgets; these tests pin its expected behaviour on a small case.

// kvforge-control's test helpers (shipped specs, synthetic views, the `SimCache` driver).
#[path = "../../kvforge-control/tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use common::*;
use kvforge_control::*;
use kvforge_lab::frontier::{Scenario, Signal, World};
use kvforge_lab::synth::HeadShape;
use kvforge_spec::{KeyScheme, TierId};

/// Tokens in full pages per head (48 pages of 64 tokens), and the dense tail.
const FULL_TOKENS: usize = 3072;
const TAIL: usize = 20;
/// Prefill observation queries (the importance signal) and held-out test queries per head.
const OBS: usize = 16;
const TEST: usize = 8;

type Worlds = HashMap<(String, u64), Arc<OnceLock<Arc<World>>>>;

/// Worlds are built once per test binary (coding every page in every tier is slow in debug).
fn world(name: &str, seed: u64) -> Arc<World> {
    static CACHE: OnceLock<Mutex<Worlds>> = OnceLock::new();
    let cell = CACHE.get_or_init(Default::default).lock().unwrap().entry((name.to_string(), seed)).or_default().clone();
    cell.get_or_init(|| Arc::new(build_world(name, seed))).clone()
}

/// Head 0 peaked (24 heavy hitters, 2 needles), head 1 diffuse; keys near the first tier's
/// codewords for a spherical spec (keys like those its codebook was trained on), isotropic
/// otherwise; radius scales without headroom.
fn build_world(name: &str, seed: u64) -> World {
    let spec = spec(name);
    let mut sc = Scenario::new(FULL_TOKENS + TAIL, 2, seed);
    sc.shapes = vec![HeadShape::PEAKED, HeadShape::DIFFUSE];
    sc.gqa = 4;
    (sc.prefill_queries, sc.decode_queries, sc.test_queries) = (OBS, 0, TEST);
    sc.radius_headroom = 1.0;
    sc.key_codebook = match &spec.tiers[1].key {
        KeyScheme::Spherical { codebook, .. } => Some(codebook.clone()),
        _ => None,
    };
    World::build(&spec, &sc)
}

/// The controllers' input: page masses (and, with `token_masses`, per-token masses) from
/// the observation queries' exact attention, through the runtime's view of a `SimCache`.
fn view_of(w: &World, token_masses: bool) -> PageTableView {
    w.cache_and_view(&Signal::ColumnSums { per_token: token_masses }).2
}

/// Pooled relative L2 error of the test queries' attention outputs with pages in
/// `tiers[h][page]` (`None`: dropped).
fn error(w: &World, tiers: &[Vec<Option<TierId>>]) -> f64 {
    w.errors(&tiers.to_vec()).pooled()
}

fn tiers_of(view: &PageTableView, plan: &Plan) -> Vec<Vec<Option<TierId>>> {
    let drop = view.costs.drop_tier();
    let full = view.heads[0].len() - 1;
    (0..view.heads.len()).map(|h| (0..full).map(|i| plan.tier_of(PageId { head: h, index: i }, view).filter(|&t| Some(t) != drop)).collect()).collect()
}

/// Uniform quantisation as KIVI-style baselines do it: every page the controllers must
/// protect (sink, recent window) stays in the first tier, every other full page is in `t`.
/// Returns the tiers and their bytes, the budget the controller gets.
fn uniform(w: &World, t: TierId, protection: &Protection) -> (Vec<Vec<Option<TierId>>>, f64) {
    w.uniform(t, Some(protection))
}

fn run(name: &str, ctrl: &mut dyn FnMut() -> Box<dyn Controller>, label: &str, fracs: &[f64]) {
    run_with(name, ctrl, label, fracs, true)
}

/// (a) error falls as the budget rises; (b) versus uniform quantisation at equal bytes,
/// asserted when `must_beat_uniform`.
fn run_with(name: &str, ctrl: &mut dyn FnMut() -> Box<dyn Controller>, label: &str, fracs: &[f64], must_beat_uniform: bool) {
    let w = world(name, 42);
    let v = view_of(&w, true);
    assert_eq!((w.full, w.tail), (FULL_TOKENS / w.spec.page.tokens, TAIL));
    let protection = Protection::default();
    let full_bytes = v.cost();
    println!("\n[{name}] {label}: relative output error vs exact attention ({} kv heads, {} tokens each)", v.heads.len(), v.context_tokens);
    println!("  all pages in `{}`: error {:.4e} at {:.0} B", w.spec.tiers[1].name, error(&w, &vec![vec![Some(1); w.full]; 2]), full_bytes);
    // (a) error falls as the budget rises.
    let mut errs = Vec::new();
    for &f in fracs {
        let l = Limits { budget: Budget::Total(full_bytes * f), protection };
        let plan = ctrl().decide(&v, &l);
        check_plan(&v, &plan, &l).unwrap();
        assert!(plan.feasible, "{label} at {f}");
        let e = error(&w, &tiers_of(&v, &plan));
        let drop = v.costs.drop_tier();
        let hist: Vec<String> = w
            .spec
            .tiers
            .iter()
            .skip(1)
            .map(|t| {
                format!(
                    "{}:{}",
                    t.name,
                    simulate(&v, &plan).iter().filter(|(_, p)| p.tier == t.id).count() + if Some(t.id) == drop { plan.decisions.iter().filter(|d| Some(d.to_tier) == drop).count() } else { 0 }
                )
            })
            .collect();
        println!("  budget {:>4.0}%: error {e:.4e}  predicted D {:.4e}  pages [{}]", f * 100.0, plan.distortion_after, hist.join(" "));
        errs.push(e);
    }
    for (i, p) in errs.windows(2).enumerate() {
        assert!(p[1] <= p[0] * 1.02 + 1e-12, "{label}: error rises from {:.4e} to {:.4e} between budgets {} and {}", p[0], p[1], fracs[i], fracs[i + 1]);
    }
    assert!(errs.last() < errs.first(), "{label}: more budget must help overall");
    // (b) beats uniform quantisation at equal bytes.
    for t in w.spec.tiers.iter().skip(2).filter(|t| !t.is_drop()) {
        let (tiers, bytes) = uniform(&w, t.id, &protection);
        let ue = error(&w, &tiers);
        let l = Limits { budget: Budget::Total(bytes), protection };
        let plan = ctrl().decide(&v, &l);
        check_plan(&v, &plan, &l).unwrap();
        assert!(plan.feasible && plan.cost_after <= bytes);
        let e = error(&w, &tiers_of(&v, &plan));
        println!("  equal bytes as uniform `{}` (protected pages in `{}`, {:.0} B): uniform {ue:.4e}, {label} {e:.4e} ({:.1}x lower)", t.name, w.spec.tiers[1].name, bytes, ue / e);
        if must_beat_uniform {
            assert!(e < ue, "{label} ({e:.4e}) does not beat uniform `{}` ({ue:.4e}) at {bytes} B", t.name);
        }
    }
}

const FRACS: [f64; 6] = [0.12, 0.2, 0.3, 0.45, 0.65, 0.9];

#[test]
fn rdr_on_rdkv_ladder() {
    run("rdkv", &mut || Box::new(rdr("rdkv")), "RDR", &FRACS);
}

#[test]
fn rdr_on_spherical_ladder() {
    run("spherical", &mut || Box::new(rdr("spherical")), "RDR", &[0.35, 0.5, 0.65, 0.8, 0.95]);
}

#[test]
fn rdkv_pages_on_rdkv_ladder() {
    // The paper's linear page weights tie uniform quantisation here (see `run_rdkv_linear`);
    // with the concentration proxy RDKV's knapsack beats it.
    let s = spec("rdkv");
    run(
        "rdkv",
        &mut || {
            let mut c = RdkvController::new(&s).unwrap();
            c.proxy = distortion::Proxy::Concentration;
            Box::new(c)
        },
        "RDKV (concentration)",
        &FRACS,
    );
}

#[test]
fn rdkv_pages_linear_weights() {
    let s = spec("rdkv");
    run_with("rdkv", &mut || Box::new(RdkvController::new(&s).unwrap()), "RDKV (paper, linear)", &FRACS, false);
}

#[test]
fn rdr_on_spherical_ladder_calibrated() {
    // Seed 000 C.2's protocol in miniature: measure each tier's NMSE on the data and give the
    // controller that table instead of the proxy (which assumes uniform key directions).
    let w = world("spherical", 7);
    let (kn, vn): (Vec<f64>, Vec<f64>) = w.tier_nmse().into_iter().unzip();
    let table = DistortionTable::from_nmse(&w.spec, &kn, &vn).unwrap();
    println!("calibrated spherical ε: {:?} (proxy: {:?})", table.eps, DistortionTable::from_spec(&w.spec).eps);
    run("spherical", &mut || Box::new(RdrController::with_table(table.clone())), "RDR calibrated", &[0.35, 0.5, 0.65, 0.8, 0.95]);
}

#[test]
fn needles_and_sinks_survive_tight_budgets() {
    let w = world("rdkv", 42);
    let v = view_of(&w, true);
    let protection = Protection::default();
    // At the bytes of uniform b4 and b2 (the tightest uniform point).
    for t in [3, 4] {
        let l = Limits { budget: Budget::Total(uniform(&w, t, &protection).1), protection };
        let plan = rdr("rdkv").decide(&v, &l);
        let drop = v.costs.drop_tier().unwrap();
        assert_eq!(w.heads[0].needles.len(), 2);
        for &needle in &w.heads[0].needles {
            let page = needle / w.spec.page.tokens;
            let tier = plan.tier_of(PageId { head: 0, index: page }, &v).unwrap();
            assert!(tier != drop, "at uniform tier {t} bytes: needle page {page} dropped");
        }
        // The sink page is protected.
        for h in 0..2 {
            assert_eq!(plan.tier_of(PageId { head: h, index: 0 }, &v), Some(1));
        }
    }
}
