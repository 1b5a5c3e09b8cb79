//! Where a coded allocation's size goes on a cache it was not calibrated on: per side, the
//! models' expected bits per token (the budget the calibration planned), the measured
//! cross-entropy of the cache's codes under the models (what `rans` pays, about), and the
//! plug-in entropy of each component's (or pooled group's) own codes on this cache (a floor
//! for any static model adapted to it; biased low for wide codes on few tokens), and the
//! squared error per token in the decorrelated (weighted) domain, the quantised components'
//! and the dropped ones' energy, as a share of the tokens' energy.
//!
//! `cargo run --release -p kvforge-kvtc --example rate_check -- <calibration> <dump> <ratio>`

use kvforge_kvtc::calib::features;
use kvforge_kvtc::codec::{basis_matrix, project, split};
use kvforge_kvtc::{pack, Calibration, KvDump, Side};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: rate_check <calibration.safetensors> <dump.safetensors> <ratio>");
        std::process::exit(2);
    }
    let cal = Calibration::load(args[1].as_ref()).unwrap_or_else(|e| panic!("{}: {e}", args[1]));
    let dump = KvDump::load(args[2].as_ref()).unwrap_or_else(|e| panic!("{}: {e}", args[2]));
    let ratio: f64 = args[3].parse().expect("a ratio");
    let ri = cal.ratio_index(ratio).unwrap_or_else(|| panic!("ratio {ratio} not in {:?}", cal.ratios));
    let (_, coded) = split(dump.tokens, cal.sinks, cal.window);
    let n = coded.len();
    for side in [Side::Keys, Side::Values] {
        let a = &cal.side(side).allocations[ri];
        let comps = a.used_components();
        let bt = basis_matrix(cal.side(side), cal.features(), comps);
        let d = project(&dump, &cal, side, coded.clone(), &bt);
        let raw = pack::encode(&d, n, comps, a);
        // error: the coded components' against their decoded values, plus everything else
        let back = pack::decode(&raw, n, comps, a);
        let s = cal.side(side);
        let mut row = vec![0.0; cal.features()];
        let total: f64 = coded
            .clone()
            .map(|t| {
                features(&dump, side, t, cal.rope, &mut row);
                row.iter().enumerate().map(|(f, &x)| ((x - s.mean[f] as f64) * s.scale.get(f).map_or(1.0, |&q| q as f64)).powi(2)).sum::<f64>()
            })
            .sum();
        let in_comps: f64 = d.iter().map(|x| x * x).sum();
        let err: f64 = d.iter().zip(&back).map(|(x, y)| (x - y) * (x - y)).sum::<f64>() + (total - in_comps);
        // centroid reconstruction: one offset toward zero per band of components (8 bands of the
        // kept components by index, fitted on this cache, so an upper bound on the gain)
        let kept_j: Vec<usize> = a.groups.iter().flat_map(|g| g.start as usize..(g.start + g.len) as usize).collect();
        let mut saved = 0.0;
        let mut offsets = Vec::new();
        for b in 0..8 {
            let js = &kept_j[b * kept_j.len() / 8..(b + 1) * kept_j.len() / 8];
            let (mut sr, mut cnt) = (0.0, 0.0);
            for t in 0..n {
                for &j in js {
                    let (x, y) = (d[t * comps + j], back[t * comps + j]);
                    if y != 0.0 {
                        sr += (x - y) * y.signum();
                        cnt += 1.0;
                    }
                }
            }
            let delta = if cnt > 0.0 { sr / cnt } else { 0.0 };
            saved += cnt * delta * delta;
            offsets.push(delta / a.step.max(1e-30) as f64);
        }
        println!("{:<6} {ratio}x: centroid offsets per band (steps) {:.3?}: error −{:.2}%", side.name(), offsets, 100.0 * saved / err);
        // per token gain class (4 quartiles of the RMS of its kept components over their step)
        let kept: Vec<usize> = a.groups.iter().flat_map(|g| g.start as usize..(g.start + g.len) as usize).collect();
        let energy: Vec<f64> = (0..n).map(|t| kept.iter().map(|&j| d[t * comps + j].powi(2)).sum::<f64>()).collect();
        let mut sorted = energy.clone();
        sorted.sort_by(f64::total_cmp);
        let q = [sorted[n / 4], sorted[n / 2], sorted[3 * n / 4]];
        let class: Vec<usize> = energy.iter().map(|&e| q.iter().filter(|&&x| e > x).count()).collect();
        let mut cond = 0.0;
        let (mut planned, mut cross, mut floor) = (0.0, 0.0, 0.0);
        // per band of the kept components (8 by index): planned and measured bits per token
        let band = |j: usize| kept.partition_point(|&x| x < j) * 8 / kept.len().max(1);
        let (mut band_plan, mut band_cross) = ([0.0f64; 8], [0.0f64; 8]);
        let mut pos = 0;
        for (g, m) in a.groups.iter().zip(&a.models) {
            pos += 4 * n;
            let (bits, len) = (g.bits as usize, g.len as usize);
            let k = 1usize << bits;
            let per_coord = m.len() != k;
            planned += kvforge_kvtc::model::group_bits(g, m) + if kvforge_kvtc::model::stores_scales(g) { 32.0 } else { 0.0 };
            let mut hist = vec![vec![0u32; k]; if per_coord { len } else { 1 }];
            let mut chist = vec![vec![0u32; k]; 4 * if per_coord { len } else { 1 }];
            for (i, c) in pack::codes(&raw[pos..], bits as u32).take(n * len).enumerate() {
                let c = c as usize;
                let mi = if per_coord { i % len } else { 0 };
                hist[mi][c] += 1;
                chist[class[i / len] * hist.len() + mi][c] += 1;
                let p = m[mi * k + c] as f64 / (1u64 << kvforge_kvtc::model::PRECISION) as f64;
                cross -= p.log2();
                band_cross[band(g.start as usize + i % len)] -= p.log2() / n as f64;
            }
            pos += (n * len * bits).div_ceil(8);
            for j in 0..len {
                let mm = if per_coord { &m[j * k..(j + 1) * k] } else { &m[..k] };
                band_plan[band(g.start as usize + j)] += kvforge_kvtc::model::model_bits_per_code(mm);
            }
            for h in &hist {
                let t: f64 = h.iter().map(|&x| x as f64).sum();
                floor -= h.iter().filter(|&&x| x > 0).map(|&x| x as f64 * (x as f64 / t).log2()).sum::<f64>();
            }
            for h in &chist {
                let t: f64 = h.iter().map(|&x| x as f64).sum();
                cond -= h.iter().filter(|&&x| x > 0).map(|&x| x as f64 * (x as f64 / t).log2()).sum::<f64>();
            }
            if kvforge_kvtc::model::stores_scales(g) {
                cross += 32.0 * n as f64;
                floor += 32.0 * n as f64;
            }
        }
        println!("{:<6} {ratio}x: squared error {:.4} per token of {:.4} ({:.3}%)", side.name(), err / n as f64, total / n as f64, 100.0 * err / total);
        let pct: Vec<String> = band_plan.iter().zip(&band_cross).map(|(p, c)| format!("{:.0}→{:+.1}%", p, 100.0 * (c / p - 1.0))).collect();
        println!("{:<6} {ratio}x: per band of kept components, planned bits → measured: {}", side.name(), pct.join(" "));
        println!("{:<6} {ratio}x: own-codes entropy given the token's gain quartile {:.0} bits/token (plus 2 for the class)", side.name(), cond / n as f64);
        println!(
            "{:<6} {ratio}x: planned {:.0} bits/token, measured cross-entropy {:.0} ({:+.1}%), own-codes entropy {:.0} ({:+.1}%), {} tokens, step {}",
            side.name(),
            planned,
            cross / n as f64,
            100.0 * (cross / n as f64 / planned - 1.0),
            floor / n as f64,
            100.0 * (floor / n as f64 / planned - 1.0),
            n,
            a.step
        );
    }
}
