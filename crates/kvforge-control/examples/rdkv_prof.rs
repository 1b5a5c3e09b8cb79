//! RDKV's allocation after prefill at 32K tokens × 8 kv heads, piece by piece, for profiling
//! (`perf record`) and quick A/B on a shared machine: the same inputs as `controller_cost rdkv`
//! (same seed, same plan digest), timed as median and minimum over the repetitions (the
//! minimum is the steadier number when other jobs share the cores).
//!
//! * `view`, `decide`: what `controller_cost rdkv --pages-only` times;
//! * `solve_head`: `knapsack::solve_flat` on kv head 0's pages alone (512 items of 5 tiers);
//! * `allocate_head` (with `--paper`): seed 002's per-token/per-channel allocation of one head.
//!
//! `--only view|decide|solve` repeats that part alone (the others once).
//!
//!     taskset -c 1 cargo run --release -p kvforge-control --example rdkv_prof -- specs/rdkv.toml --reps 300 --paper
#[path = "common/rdkv_case.rs"]
mod rdkv_case;

use std::time::Instant;

use kvforge_control::rdkv::{allocate_head, EPS_K_LLAMA31_8B, EPS_V_LLAMA31_8B};
use kvforge_control::runtime::Signal;
use kvforge_control::*;
use rdkv_case::RdkvCase;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// `(median, min)` of microsecond samples.
fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0])
}

fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> (f64, f64, T) {
    let mut ts = Vec::with_capacity(reps);
    let mut last = None;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let r = f();
        ts.push(t.elapsed().as_secs_f64() * 1e6);
        last = Some(std::hint::black_box(r));
    }
    let (med, min) = stats(&mut ts);
    (med, min, last.expect("one repetition"))
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let spec_path = args.iter().find(|a| a.ends_with(".toml")).cloned().unwrap_or("specs/rdkv.toml".into());
    let reps: usize = args.iter().position(|a| a == "--reps").and_then(|i| args.get(i + 1)).and_then(|s| s.parse().ok()).unwrap_or(200);
    let paper = args.iter().any(|a| a == "--paper");
    // `--only view|decide|solve`: repeat that part alone (the others run once), for `perf record`.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let reps_of = |part: &str| if only.as_deref().is_none_or(|o| o == part) { reps } else { 1 };
    let spec = kvforge_spec::Spec::load(spec_path.as_ref()).map_err(|e| e.to_string())?;
    let RdkvCase { d, heads, ctx, tok, cw, limits, cache, pos, rdkv, costs } = RdkvCase::new(&spec)?;
    let view_once = || {
        pos.view_par(&cache, costs.clone(), |key, len| {
            let m = &tok[key.head][key.first_token..key.first_token + len];
            Signal { mass: m.iter().sum(), token_mass: rdkv.proxy.uses_token_mass().then(|| m.to_vec()), pinned: false }
        })
    };
    let (view_med, view_min, view) = time(reps_of("view"), view_once);
    let view = view?;
    let (dec_med, dec_min, plan) = time(reps_of("decide"), || rdkv.clone().decide(&view, &limits));
    let digest = plan.decisions.iter().fold(0u64, |h, x| h.wrapping_mul(1_000_003) ^ ((x.page.head * 100_000 + x.page.index) as u64 * 16 + x.to_tier as u64));
    // Head 0 as the controller poses it (every page but the protected ones has the ladder
    // from its tier down; protected pages are fixed at b16 by the default floor).
    let weights = rdkv.proxy.weights(&view);
    let (mut choices, mut start, mut fixed) = (Vec::new(), vec![0usize], 0.0);
    for (i, page) in view.heads[0].iter().enumerate() {
        let tiers: Vec<_> = limits.protection.allowed_tiers(page, view.context_tokens, &view.costs).collect();
        if tiers.len() <= 1 {
            fixed += view.costs.cost(page.tier, page.tokens);
            continue;
        }
        choices.extend(tiers.iter().map(|&t| knapsack::Choice::new(view.costs.cost(t, page.tokens), rdkv.table.page(weights[i], t))));
        start.push(choices.len());
    }
    let share = limits.budget.bytes(view.context_tokens, heads) / heads as f64 - fixed;
    let (solve_med, solve_min, sol) = time(reps_of("solve"), || knapsack::solve_flat(&choices, &start, share));
    // What a decision pays to start threads for 8 heads (scoped, each doing nothing).
    let (spawn_med, spawn_min, _) = time(reps_of("spawn"), || std::thread::scope(|sc| (0..8).map(|h| sc.spawn(move || h)).collect::<Vec<_>>().into_iter().map(|j| j.join().unwrap_or(0)).sum::<usize>()));
    print!("{{\"spawn8_us\":[{spawn_med:.1},{spawn_min:.1}],");
    print!(
        "\"view_us\":[{view_med:.1},{view_min:.1}],\"decide_us\":[{dec_med:.1},{dec_min:.1}],\"solve_head_us\":[{solve_med:.1},{solve_min:.1}],\"head_items\":{},\"head_lambda\":{:e},\"plan_digest\":\"{digest:016x}\"",
        start.len() - 1,
        sol.lambda
    );
    if paper {
        let budget_bits = 2.0 * (ctx * d * 2) as f64;
        let (med, min, a) = time(reps.div_ceil(10), || allocate_head(&tok[0], &cw, &EPS_V_LLAMA31_8B, &EPS_K_LLAMA31_8B, budget_bits, d));
        let h = a.v.bits.iter().chain(&a.k.bits).fold(0u64, |h, &b| h.wrapping_mul(31) ^ u64::from(b));
        print!(",\"allocate_head_us\":[{med:.1},{min:.1}],\"allocate_digest\":\"{h:016x}\",\"allocate_v\":[{:e},{:e},{:e}]", a.v.distortion, a.v.lambda, a.v.duality_gap);
    }
    println!("}}");
    Ok(())
}
