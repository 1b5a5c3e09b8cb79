//! Runs the certified-attention validation plan (`certified::trials::PLAN`, the same trials
//! as `tests/certified.rs`) and the fault campaign, and writes the results as JSON.
//!
//! ```bash
//! cargo run --release -p kvforge-ref --example certified_trials -- benches/results/certified-cpu-2026-11-23.json
//! ```

use std::collections::BTreeMap;
use std::time::Instant;

use kvforge_ref::certified::faults::campaign;
use kvforge_ref::certified::trials::{run_workload, TrialStats, Workload, PLAN, SEED};
use kvforge_ref::certified::CertConfig;
use serde_json::json;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).unwrap_or_else(|| "benches/results/certified-cpu-2026-11-23.json".into());
    // Optional fraction of the plan (profiling); the committed results use the whole plan.
    let fraction: f64 = std::env::args().nth(2).map_or(1.0, |f| f.parse().expect("fraction"));
    let cfg = CertConfig::default();
    let t0 = Instant::now();
    // Optional workload filter (profiling).
    let only = std::env::args().nth(3);
    let plan: Vec<(Workload, u64)> = PLAN.iter().filter(|(w, _)| only.as_ref().is_none_or(|o| format!("{w:?}") == *o)).map(|&(w, n)| (w, ((n as f64 * fraction).ceil() as u64).max(1))).collect();
    // Workloads one after another; each spreads its layer steps over the cores.
    let mut results = BTreeMap::<Workload, TrialStats>::new();
    for &(w, n) in &plan {
        let t = Instant::now();
        let st = run_workload(w, n, SEED, &cfg)?;
        eprintln!("{w:?}: {} head-steps in {:.1} s, {} violations", st.trials, t.elapsed().as_secs_f64(), st.violations);
        results.insert(w, st);
    }
    // The key term alone: every value promoted (v_tol = 0, so E_val = 0), so the measured
    // error is Σ(a' − a)V_t and its ratio to E_key + E_round is the key term's tightness.
    let key_cfg = CertConfig { values: kvforge_ref::certified::ValuePolicy::Threshold { v_tol: 0.0 }, ..cfg.clone() };
    let mut key_only = BTreeMap::new();
    for w in [Workload::Random, Workload::OutlierChannels, Workload::Peaked, Workload::Medium] {
        let n = if w == Workload::Medium { 240 } else { 4_000 };
        let st = run_workload(w, ((n as f64 * fraction).ceil() as u64).max(8), SEED ^ 0x6b_6579, &key_cfg)?;
        eprintln!("{w:?} (key term only): {} head-steps, {} violations", st.trials, st.violations);
        key_only.insert(serde_json::to_value(w)?.as_str().unwrap().to_string(), json!({ "trials": st.trials, "violations": st.violations, "paper_eq15_violations": st.paper_violations, "rungs": st.rungs, "tightness": st.quantiles(), "tightness_paper_eq15": st.quantiles_paper() }));
    }
    let mut all = TrialStats::default();
    results.values().for_each(|s| all.merge(s));
    let faults = campaign(50, SEED)?;
    let per: BTreeMap<String, serde_json::Value> =
        results.iter().map(|(w, s)| (serde_json::to_value(w).unwrap().as_str().unwrap().to_string(), json!({ "stats": s, "tightness": s.quantiles(), "tightness_paper_eq15": s.quantiles_paper() }))).collect();
    let report = json!({
        "device": "cpu f64 reference",
        "date": "2026-11-23",
        "seed": SEED,
        "config": cfg,
        "bound": "E_key + E_val + E_round, E_key = 2 V_max min{(e^Δ − 1) ᾱ, tanh(Δ/2)}, ᾱ = α̂e^{2Δ}/(1 + α̂(e^{2Δ} − 1)) (crates/kvforge-ref/src/certified/certificate.rs)",
        "plan_fraction": fraction,
        "trials": all.trials,
        "violations": all.violations,
        "paper_eq15_violations": all.paper_violations,
        "violations_without_e_round": all.without_round_violations,
        "fast_path_exact": all.fast_exact,
        "tightness": all.quantiles(),
        "tightness_paper_eq15": all.quantiles_paper(),
        "worst_actual_over_bound": all.worst_ratio,
        "worst_share_of_e_round_used": all.worst_round_share,
        "rungs": all.rungs,
        "faults_injected": faults.injected,
        "faults_detected": faults.detected,
        "faults": faults,
        "workloads": per,
        "key_term_only": key_only,
        "wall_s": t0.elapsed().as_secs_f64(),
    });
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    eprintln!("{} head-steps, {} violations, {}/{} faults detected, {:.1} s → {path}", all.trials, all.violations, faults.detected, faults.injected, t0.elapsed().as_secs_f64());
    Ok(())
}
