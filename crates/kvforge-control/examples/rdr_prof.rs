//! RDR's steady-state invocation at 32K tokens × 8 kv heads on a `SimCache`, repeated, with
//! log-uniform random page importances jittered ±30% per window: a quick way to time and
//! profile (`perf record`) roll / view / decide / apply without the synthetic-attention setup
//! of `kvforge frontier`, which dominates a profile of that command (issue 7's decision cost).
//!
//!     cargo run --release -p kvforge-control --example rdr_prof -- specs/rdkv.toml 300
use kvforge_control::runtime::{self, PositionMap, SimCache};
use kvforge_control::*;
use rand::{Rng, SeedableRng};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let spec_path = std::env::args().nth(1).unwrap_or("specs/rdkv.toml".into());
    let n: usize = std::env::args().nth(2).map_or(Ok(300), |s| s.parse())?;
    let spec = kvforge_spec::Spec::load(spec_path.as_ref())?;
    let (d, heads, ctx) = (128, 8, 32768);
    let p = spec.page.tokens;
    let costs = TierCosts::from_spec(&spec, d, CostModel::Resident);
    let fp16 = costs.cost(kvforge_spec::TAIL_TIER, p) / p as f64;
    let frac = if spec.name == "rdkv" { 0.25 } else { 0.45 };
    let limits = Limits { budget: Budget::PerToken(frac * fp16), protection: Protection::default() };
    let mut cache = SimCache::new(spec.clone(), d, heads, 1);
    let seq = cache.add_sequence();
    cache.append(seq, ctx);
    let mut pos = PositionMap::new(seq, heads);
    pos.sync(&cache)?;
    let mut imp = PagedImportance::new(0.5, p)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let base: Vec<Vec<f64>> = (0..heads).map(|_| (0..(ctx + 64 * n) / p + 2).map(|_| (rng.gen::<f64>() * 20.0 - 20.0).exp()).collect()).collect();
    let mut rdr = RdrController::new(&spec);
    let win = |firsts: &[Vec<usize>], rng: &mut rand_chacha::ChaCha8Rng| -> Vec<Vec<Option<f64>>> {
        firsts.iter().enumerate().map(|(h, fs)| fs.iter().map(|&f| Some(base[h][f / p] * (1.0 + 0.3 * rng.gen::<f64>()))).collect()).collect()
    };
    let firsts = pos.first_tokens(&cache)?;
    imp.roll(&firsts, &win(&firsts, &mut rng))?;
    let view = pos.view(&cache, costs.clone(), |k, _| runtime::Signal { mass: imp.get(k), ..Default::default() })?;
    let plan = rdr.decide(&view, &limits);
    pos.apply(&mut cache, &view, &plan, &limits)?;
    let (mut tr, mut tv, mut td, mut ta) = (0.0, 0.0, 0.0, 0.0);
    let mut moves = 0;
    // Every plan, hashed (f64s by their Debug form, which round-trips): optimisations of the
    // decision must leave it unchanged.
    let mut digest = std::collections::hash_map::DefaultHasher::new();
    for _ in 0..n {
        cache.append(seq, 64);
        for _ in 0..64 {
            rdr.step();
        }
        pos.sync(&cache)?;
        let firsts = pos.first_tokens(&cache)?;
        let w = win(&firsts, &mut rng);
        let t = Instant::now();
        imp.roll(&firsts, &w)?;
        tr += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let view = pos.view(&cache, costs.clone(), |k, _| runtime::Signal { mass: imp.get(k), ..Default::default() })?;
        tv += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let plan = rdr.decide(&view, &limits);
        td += t.elapsed().as_secs_f64();
        let t = Instant::now();
        pos.apply(&mut cache, &view, &plan, &limits)?;
        ta += t.elapsed().as_secs_f64();
        moves += plan.decisions.len();
        std::hash::Hash::hash(&format!("{plan:?}"), &mut digest);
    }
    let us = |x: f64| x * 1e6 / n as f64;
    println!(
        "{}: mean per invocation roll {:.0} view {:.0} decide {:.0} apply {:.0} us, {:.1} moves; plans digest {:016x}",
        spec.name,
        us(tr),
        us(tv),
        us(td),
        us(ta),
        moves as f64 / n as f64,
        std::hash::Hasher::finish(&digest)
    );
    Ok(())
}
