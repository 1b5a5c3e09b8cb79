//! Shared helpers: shipped specs, synthetic views, a multi-step driver over `SimCache`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use kvforge_control::runtime::{PositionMap, Signal, SimCache};
use kvforge_control::*;
use kvforge_spec::{Spec, TierId, TAIL_TIER};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const D: usize = 128;

/// A shipped spec and its default distortion table, loaded once per test binary (the
/// spherical table samples the codebooks, which is slow in debug builds).
fn cached(name: &str) -> (Spec, DistortionTable) {
    static CACHE: OnceLock<Mutex<HashMap<String, (Spec, DistortionTable)>>> = OnceLock::new();
    let mut m = CACHE.get_or_init(Default::default).lock().unwrap();
    m.entry(name.to_string())
        .or_insert_with(|| {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../specs").join(format!("{name}.toml"));
            let s = Spec::load(&path).unwrap_or_else(|e| panic!("{e}"));
            let t = DistortionTable::from_spec(&s);
            (s, t)
        })
        .clone()
}

pub fn spec(name: &str) -> Spec {
    cached(name).0
}

/// An RDR controller with the spec's default table.
pub fn rdr(name: &str) -> RdrController {
    RdrController::with_table(cached(name).1)
}

pub fn costs(spec: &Spec, model: CostModel) -> TierCosts {
    TierCosts::from_spec(spec, D, model)
}

/// A view of `heads` kv heads with `full` full pages each at `tier`, plus a tail of `tail`
/// tokens; page (h, i) has mass `mass(h, i)` (normalised afterwards).
pub fn view(spec: &Spec, heads: usize, full: usize, tier: TierId, tail: usize, mass: impl Fn(usize, usize) -> f64) -> PageTableView {
    let p = spec.page.tokens;
    let mut hs = Vec::new();
    for h in 0..heads {
        let mut pages = Vec::new();
        for i in 0..full {
            pages.push(PageInfo { tier, tokens: p, first_token: i * p, last_token: i * p + p - 1, mass: mass(h, i), token_mass: None, pinned: false });
        }
        if tail > 0 {
            pages.push(PageInfo { tier: TAIL_TIER, tokens: tail, first_token: full * p, last_token: full * p + tail - 1, mass: mass(h, full), token_mass: None, pinned: false });
        }
        hs.push(pages);
    }
    let mut v = PageTableView { seq: 0, context_tokens: full * p + tail, heads: hs, costs: costs(spec, CostModel::Resident) };
    v.normalise();
    v
}

/// Heavy-tailed random masses (a few heavy hitters, many light pages).
pub fn heavy_tailed(rng: &mut ChaCha8Rng) -> f64 {
    let u: f64 = rng.gen_range(1e-6..1.0);
    u.powf(6.0)
}

/// Bytes of a sequence in a cache under a cost model.
pub fn cache_bytes(cache: &SimCache, seq: usize, costs: &TierCosts) -> f64 {
    use kvforge_control::runtime::PagedCache;
    (0..cache.num_kv_heads()).flat_map(|h| cache.page_tiers(seq, h).unwrap()).map(|(t, n)| costs.cost(t, n)).sum()
}

/// One step of a simulated decode: what happened to every page.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Per page key: (step, tier) at every invocation where it existed.
    pub tiers: std::collections::BTreeMap<PageKey, Vec<(u64, TierId)>>,
    pub plans: Vec<(u64, Plan, PageTableView)>,
}

/// Drives `ctrl` over `steps` decode steps on a `SimCache`: `prefill` tokens first, then one
/// token per step; page masses drift randomly with noise; the controller runs when its step
/// counter says so (RDR) or every `every` steps otherwise. Asserts every plan with the
/// checker and the cache bytes against the budget.
pub struct Driver {
    pub spec: Spec,
    pub heads: usize,
    pub limits: Limits,
    pub seed: u64,
    pub prefill: usize,
    pub steps: usize,
    /// Relative noise on importance per invocation.
    pub noise: f64,
    pub pinned_every: Option<usize>,
}

impl Driver {
    pub fn run(&self, rdr: &mut RdrController) -> Trace {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let costs = costs(&self.spec, CostModel::Resident);
        let mut cache = SimCache::new(self.spec.clone(), D, self.heads, 1);
        let seq = cache.add_sequence();
        let mut pos = PositionMap::new(seq, self.heads);
        let mut base = std::collections::HashMap::new();
        let mut trace = Trace::default();
        cache.append(seq, self.prefill);
        for _ in 0..self.steps {
            cache.append(seq, 1);
            if !rdr.step() {
                continue;
            }
            pos.sync(&cache).unwrap();
            let noise = self.noise;
            let pt = self.spec.page.tokens;
            let pinned_every = self.pinned_every;
            let view = pos
                .view(&cache, costs.clone(), |key, _| {
                    let b = *base.entry(key).or_insert_with(|| heavy_tailed(&mut rng));
                    let m = b * (1.0 + noise * rng.gen_range(-1.0..1.0));
                    let pinned = pinned_every.is_some_and(|e| (key.first_token / pt) % e == 3);
                    Signal { mass: m, token_mass: None, pinned }
                })
                .unwrap();
            let plan = rdr.decide(&view, &self.limits);
            check_plan(&view, &plan, &self.limits).unwrap_or_else(|v| panic!("step {}: {v}", rdr.steps()));
            pos.apply(&mut cache, &view, &plan, &self.limits).unwrap();
            let bytes = cache_bytes(&cache, seq, &costs);
            assert_eq!(bytes, plan.cost_after, "the cache holds what the plan said");
            if plan.feasible {
                assert!(bytes <= plan.budget_bytes, "step {}: {bytes} B over the {} B budget", rdr.steps(), plan.budget_bytes);
            }
            let after = simulate(&view, &plan);
            for (id, p) in after.iter() {
                trace.tiers.entry(p.key(id.head)).or_default().push((rdr.steps(), p.tier));
            }
            trace.plans.push((rdr.steps(), plan, view));
        }
        trace
    }
}
