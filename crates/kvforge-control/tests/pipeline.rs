//! RDR planned on a thread (`RdrPipeline`) against the synchronous controller, on `SimCache`
//! decodes with random specs, heads, budgets, protection and importance windows.

mod common;

use common::*;
use kvforge_control::runtime::{PagedCache, PositionMap, Signal, SimCache};
use kvforge_control::*;
use kvforge_spec::TAIL_TIER;
use proptest::prelude::*;

/// A page's largest share over window `k`: a fixed function of (seed, head, first token, k),
/// so both decodes observe the same masses for the same pages.
fn share(seed: u64, head: usize, first: usize, k: usize) -> f64 {
    let mut x = seed ^ (head as u64) << 48 ^ (first as u64) << 8 ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // splitmix64
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    let u = (x >> 11) as f64 / (1u64 << 53) as f64;
    // Heavy tailed, like attention shares over pages.
    u.powf(6.0)
}

fn window(seed: u64, firsts: &[Vec<usize>], k: usize) -> Vec<Vec<Option<f64>>> {
    firsts.iter().enumerate().map(|(h, fs)| fs.iter().map(|&f| if (f / 64 + k) % 11 == 3 { None } else { Some(share(seed, h, f, k)) }).collect()).collect()
}

fn tiers<C: PagedCache>(cache: &C, seq: usize) -> Vec<Vec<(kvforge_spec::TierId, usize)>> {
    (0..cache.num_kv_heads()).map(|h| cache.page_tiers(seq, h).unwrap()).collect()
}

/// The synchronous controller at one boundary: its view, the page table before its plan, the plan.
type Boundary = (PageTableView, Vec<Vec<(kvforge_spec::TierId, usize)>>, Plan);

#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    heads: usize,
    prefill: usize,
    steps: usize,
    every: usize,
    frac: f64,
    seed: u64,
    policy: u8,
    cooldown: usize,
    protection: Protection,
    headroom: Headroom,
}

impl Case {
    fn controller(&self) -> RdrController {
        let mut rdr = rdr(self.name);
        rdr.every = self.every;
        rdr.cooldown = self.cooldown;
        rdr.drop_policy = [DropPolicy::Joint, DropPolicy::Penalty(1.0), DropPolicy::LastResort][self.policy as usize];
        rdr
    }

    fn limits(&self) -> Limits {
        let spec = spec(self.name);
        let pt = spec.page.tokens;
        let top = costs(&spec, CostModel::Resident).cost(1, pt) / pt as f64;
        Limits { budget: Budget::PerToken(top * self.frac), protection: self.protection }
    }

    /// The synchronous controller: per boundary, the view it decided on, the page table before
    /// its plan and the plan (made under the headroom's limits, applied at once).
    fn synchronous(&self) -> Vec<Boundary> {
        let spec = spec(self.name);
        let costs = costs(&spec, CostModel::Resident);
        let limits = self.limits();
        let mut cache = SimCache::new(spec.clone(), D, self.heads, 1);
        let seq = cache.add_sequence();
        cache.append(seq, self.prefill);
        let mut pos = PositionMap::new(seq, self.heads);
        let mut imp = PagedImportance::new(0.5, spec.page.tokens).unwrap();
        let mut rdr = self.controller();
        let mut out = Vec::new();
        for _ in 0..self.steps {
            cache.append(seq, 1);
            if !rdr.step() {
                continue;
            }
            let k = rdr.steps() as usize / self.every;
            pos.sync(&cache).unwrap();
            let firsts = pos.first_tokens(&cache).unwrap();
            imp.roll(&firsts, &window(self.seed, &firsts, k)).unwrap();
            let view = pos.view(&cache, costs.clone(), |key, _| Signal { mass: imp.get(key), ..Default::default() }).unwrap();
            // Boundary 1 is the pipeline's primed one: its plan lands at once, no headroom.
            let l = if k == 1 { limits } else { self.headroom.limits(&view, &limits, self.every) };
            let plan = rdr.decide(&view, &l);
            let before = tiers(&cache, seq);
            pos.apply(&mut cache, &view, &plan, &l).unwrap();
            out.push((view, before, plan));
        }
        out
    }
}

fn case() -> impl Strategy<Value = Case> {
    (prop_oneof![Just("rdkv"), Just("spherical"), Just("certified")], 1usize..4, 0usize..1200, 1usize..40, 0.05f64..1.1, any::<u64>(), 0u8..3, 0usize..48, 0usize..200, 0usize..20).prop_map(
        |(name, heads, prefill, every, frac, seed, policy, cooldown, recent, sinks)| Case {
            name,
            heads,
            prefill,
            steps: 12 * every + 7,
            every,
            frac,
            seed,
            policy,
            cooldown,
            protection: Protection { sink_tokens: sinks, recent_tokens: recent, floor: 1 },
            headroom: Headroom::None,
        },
    )
}

/// Runs the pipeline on its own cache and checks it against the synchronous controller:
/// boundary 1 is primed (its plan lands at once), every later boundary applies the plan of
/// the one before. Returns (context, cache bytes, plan feasible) after every boundary.
fn run_and_compare(c: &Case) -> Result<Vec<(usize, f64, bool)>, TestCaseError> {
    let sync = c.synchronous();
    let spec = spec(c.name);
    let costs = costs(&spec, CostModel::Resident);
    let mut cache = SimCache::new(spec.clone(), D, c.heads, 1);
    let seq = cache.add_sequence();
    cache.append(seq, c.prefill);
    let imp = PagedImportance::new(0.5, spec.page.tokens).unwrap();
    let mut pipe = RdrPipeline::new(c.controller(), imp, &spec, seq, c.heads, pipeline::Planning { costs: costs.clone(), limits: c.limits(), headroom: c.headroom }).unwrap();
    let mut landed = Vec::new();
    let mut after = Vec::new();
    for step in 1..=c.steps {
        cache.append(seq, 1);
        if !pipe.step() {
            continue;
        }
        let k = step / c.every;
        let firsts = pipe.first_tokens(&cache).unwrap();
        let b = if k == 1 { pipe.prime(&mut cache, window(c.seed, &firsts, k)).unwrap() } else { pipe.invoke(&mut cache, window(c.seed, &firsts, k)).unwrap() };
        // The page table after the boundary is the synchronous controller's at the same
        // boundary before its plan: the same plans landed, one period later.
        if k >= 2 {
            prop_assert_eq!(&tiers(&cache, seq), &sync[k - 1].1, "boundary {}: page table", k);
        }
        // Boundary 1 is primed (its plan lands at once), boundary 2 only submits its plan,
        // boundary k ≥ 3 applies the plan of boundary k − 1.
        let Some((planned, report)) = b.applied else {
            prop_assert_eq!(k, 2, "no plan landed at boundary {}", k);
            continue;
        };
        prop_assert_eq!(report.bytes_after, planned.checked.plan().cost_after);
        let (view, plan) = planned.checked.into_parts();
        let j = if k == 1 { 0 } else { k - 2 };
        prop_assert_eq!(&view, &sync[j].0, "boundary {}: the planner's view", k);
        prop_assert_eq!(&plan, &sync[j].2, "boundary {}: the plan", k);
        landed.push(plan.feasible);
        let ctx = c.prefill + step;
        after.push((ctx, cache_bytes(&cache, seq, &costs), plan.feasible));
        // Protected pages now (sinks, the recent window) are at the floor or above, none dropped.
        let firsts = pipe.first_tokens(&cache).unwrap();
        let pages = tiers(&cache, seq);
        for (h, (fs, ps)) in firsts.iter().zip(&pages).enumerate() {
            if c.protection.sink_tokens > 0 {
                prop_assert_eq!(fs.first().copied(), Some(0), "kv head {}: the sink page was dropped", h);
            }
            for (&f, &(t, n)) in fs.iter().zip(ps) {
                let last = f + n.max(1) - 1;
                let recent = last + c.protection.recent_tokens >= ctx;
                if f < c.protection.sink_tokens || recent {
                    prop_assert!(t == TAIL_TIER || t <= c.protection.floor, "kv head {h}: protected page at {f} in tier {t}");
                }
            }
        }
    }
    // The last plan is still in flight: it is the synchronous controller's last.
    let (last, _) = pipe.flush(&mut cache).unwrap().expect("the last boundary's plan");
    prop_assert_eq!(last.checked.plan(), &sync.last().unwrap().2);
    prop_assert_eq!(landed.len() + 1, sync.len());
    Ok(after)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Without headroom every plan is bit for bit the synchronous controller's plan of the
    /// same boundary, made from the same view, and lands one period later onto the page
    /// table the synchronous controller had at that point.
    #[test]
    fn plans_equal_the_synchronous_controller(c in case()) {
        run_and_compare(&c)?;
    }

    /// With arrival headroom the plans are the synchronous decision under the headroom's
    /// limits, and right after every boundary the cache is within the budget of that step.
    #[test]
    fn arrival_headroom_keeps_the_budget_at_every_boundary(mut c in case()) {
        c.headroom = Headroom::Arrivals { tier: 1 };
        let after = run_and_compare(&c)?;
        let heads = c.heads;
        let l = c.limits();
        for (i, &(ctx, bytes, feasible)) in after.iter().enumerate() {
            // Boundary 1 is primed: planned under the plain limits, it lands at once.
            if feasible {
                prop_assert!(bytes <= l.budget.bytes(ctx, heads) + 1e-9, "boundary {}: {} B over the {} B budget at {} tokens", i + 1, bytes, l.budget.bytes(ctx, heads), ctx);
            }
        }
    }
}

/// Without headroom a plan lands one period after its snapshot: the cache then holds that
/// period's arrivals on top of the planned bytes (what arrival headroom reserves).
#[test]
fn without_headroom_the_arrivals_exceed_the_budget() {
    let c = Case { name: "rdkv", heads: 2, prefill: 2048, steps: 12 * 64, every: 64, frac: 0.3, seed: 3, policy: 1, cooldown: 128, protection: Protection::default(), headroom: Headroom::None };
    let after = run_and_compare(&c).unwrap();
    let l = c.limits();
    let over = after.iter().skip(1).filter(|&&(ctx, bytes, _)| bytes > l.budget.bytes(ctx, c.heads)).count();
    assert!(over > 0, "a lagging plan without headroom should leave the arrivals over budget");
}

/// A stale plan (the cache changed behind the planner's back) is refused before any move.
#[test]
fn a_plan_for_another_page_table_is_refused() {
    let spec = spec("rdkv");
    let costs = costs(&spec, CostModel::Resident);
    let mut cache = SimCache::new(spec.clone(), D, 2, 1);
    let seq = cache.add_sequence();
    cache.append(seq, 4096);
    let limits = Limits { budget: Budget::PerToken(40.0), protection: Protection::default() };
    let mut pipe = RdrPipeline::new(rdr("rdkv"), PagedImportance::new(0.5, 64).unwrap(), &spec, seq, 2, pipeline::Planning { costs, limits, headroom: Headroom::None }).unwrap();
    let firsts = pipe.first_tokens(&cache).unwrap();
    pipe.invoke(&mut cache, window(1, &firsts, 1)).unwrap();
    // Someone else re-codes page 3 of head 0 while the plan is made.
    cache.retier(seq, 0, 3, 2).unwrap();
    let before = tiers(&cache, seq);
    let firsts = pipe.first_tokens(&cache).unwrap();
    let err = pipe.invoke(&mut cache, window(1, &firsts, 2)).unwrap_err();
    assert!(matches!(err, runtime::ControlError::Stale { head: 0, .. }), "{err}");
    assert_eq!(tiers(&cache, seq), before);
}
