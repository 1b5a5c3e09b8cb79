//! ParisKV retrieval on the device against the kvforge-paris f64 reference: summaries,
//! retrieval (batch 2, GQA 4: one retrieval per kv head for the group's summed query, ranked by
//! the summed estimate or by the group's largest head estimate, and the per-query-head option), attention over dense + retrieved rows (staged and fused UVA
//! reads), and the typed host-budget errors; the Whole64 summaries (`SummaryLayout::Whole64`,
//! 64 B per key: `whole64_*` tests) against `kvforge_paris::compact`'s encoder and retrieval. Run on the GPU machine with `-- --ignored`; the
//! NVRTC compile of the module runs on every CPU CI run (`paris_module_compiles`).

use half::f16;
use kvforge_paris::{
    exact_top_k, exact_top_k_group_max, group_query, recall, retrieve_group, retrieve_group_compact, CompactKeys, CompactSummaries, Layout, LogGrid, ParisConfig, Rank, Schedule, Summaries, SummaryLayout,
};
use kvforge_rt::paris::{ParisGeometry, ParisIndex};
use kvforge_rt::testing::Xorshift;
use kvforge_rt::{Device, RtError};

/// Keys / values / queries: a shared mean direction plus noise, from a fixed xorshift stream.
fn rows(n: usize, d: usize, salt: u64, mean: f64) -> Vec<f16> {
    let mut rng = Xorshift::new(salt);
    (0..n * d).map(|i| f16::from_f64(mean * ((i % d) as f64 * 0.37).sin() + rng.gauss())).collect()
}

/// Rows of kv head `h` out of `[rows][hkv][d]`, as f32.
fn head_rows(x: &[f16], hkv: usize, d: usize, h: usize) -> Vec<f32> {
    x.chunks_exact(hkv * d).flat_map(|r| r[h * d..(h + 1) * d].iter().map(|v| v.to_f32())).collect()
}

fn geometry() -> ParisGeometry {
    ParisGeometry {
        batch: 2,
        kv_heads: 2,
        gqa: 4,
        per_query_head: false,
        rank: Rank::default(),
        layout: SummaryLayout::Subspace4,
        capacity: 24_000,
        dense_capacity: 96,
        max_candidates: 8192,
        max_k: 128,
        host_budget_bytes: 1 << 30,
    }
}

struct Setup {
    ix: ParisIndex,
    keys: Vec<Vec<f16>>,
    values: Vec<Vec<f16>>,
    dense: Vec<(Vec<f16>, Vec<f16>)>,
}

fn setup(dev: &Device) -> Setup {
    setup_with(dev, geometry())
}

fn setup_with(dev: &Device, geo: ParisGeometry) -> Setup {
    let cfg = ParisConfig::default_for(128);
    let mut ix = ParisIndex::new(dev, cfg, geo).expect("index");
    let d = cfg.head_dim;
    let lens = [20_000, 9_000];
    let (mut keys, mut values, mut dense) = (Vec::new(), Vec::new(), Vec::new());
    for (s, &n) in lens.iter().enumerate() {
        let k = rows(n * geo.kv_heads, d, 11 + s as u64, 1.5);
        let v = rows(n * geo.kv_heads, d, 23 + s as u64, 0.0);
        // Two appends: the second continues the first's positions and occupancy (Whole64: the
        // first fixes the weight grid, `prefill_rows`).
        let cut = prefill_rows(n) * geo.kv_heads * d;
        ix.append(s, &k[..cut], &v[..cut]).expect("append");
        ix.append(s, &k[cut..], &v[cut..]).expect("append");
        let (dk, dv) = (rows(64 * geo.kv_heads, d, 31 + s as u64, 1.5), rows(64 * geo.kv_heads, d, 37 + s as u64, 0.0));
        ix.set_dense(s, &dk, &dv).expect("dense");
        keys.push(k);
        values.push(v);
        dense.push((dk, dv));
    }
    Setup { ix, keys, values, dense }
}

/// Rows of a sequence's first append in `setup_with` (of `n`).
fn prefill_rows(n: usize) -> usize {
    n / 3
}

/// The f64 reference of the device's Whole64 summaries of one kv head's `keys` (`[n][D]`): the
/// whole-vector codes on the weight grid fitted to the first `prefill` keys (paris.cuh, "Whole64").
fn whole_reference(cfg: ParisConfig, keys: &[f32], prefill: usize) -> CompactSummaries {
    let layout = Layout::whole_eighth();
    let pre = CompactKeys::encode(cfg, layout, &keys[..prefill * cfg.head_dim]).unwrap();
    let grid = LogGrid::fit(layout.steps(), pre.weights.iter().copied());
    CompactSummaries::on_grid(CompactKeys::encode(cfg, layout, keys).unwrap(), grid)
}

fn whole_geometry() -> ParisGeometry {
    ParisGeometry { layout: SummaryLayout::Whole64, ..geometry() }
}

#[test]
#[ignore = "needs a CUDA device"]
fn summaries_match_the_reference() {
    let dev = Device::open(0).expect("device");
    let s = setup(&dev);
    let (cfg, geo) = (*s.ix.config(), *s.ix.geometry());
    for seq in 0..geo.batch {
        for h in 0..geo.kv_heads {
            let got = s.ix.download_summaries(seq, h).unwrap();
            let want = Summaries::encode(cfg, &head_rows(&s.keys[seq], geo.kv_heads, cfg.head_dim, h)).unwrap();
            assert_eq!(got.n, want.n);
            assert_eq!(got.hist.iter().sum::<u32>(), want.hist.iter().sum::<u32>());
            // The device sums |k| in f32 (the reference in f64): a code may sit on the other
            // side of a threshold in rare rows.
            let ids = got.ids.iter().zip(&want.ids).filter(|(a, b)| a == b).count() as f64 / want.ids.len() as f64;
            let codes = got.codes.iter().zip(&want.codes).filter(|(a, b)| a == b).count() as f64 / want.codes.len() as f64;
            let close = (0..want.n * cfg.subspaces)
                .filter(|&i| {
                    let (a, b) = (f16::from_bits(got.weights[i]).to_f64(), f16::from_bits(want.weights[i]).to_f64());
                    (a - b).abs() <= 2e-3 * b.abs().max(1e-3)
                })
                .count() as f64
                / (want.n * cfg.subspaces) as f64;
            assert!(ids > 0.999 && codes > 0.999 && close > 0.999, "seq {seq} head {h}: ids {ids}, codes {codes}, weights {close}");
        }
    }
}

/// Whole64: the ids (the codes' sign plane) and occupancy as the seed layout's reference, the
/// grid that of the prefill, the codes and weight codes those of the reference's encoder
/// (`CompactSummaries::on_grid`) and the packed rows `WholeRow::pack`'s. The device computes
/// the norm, α and the weight's log in f64 as the reference does; its f32 rotation may put a
/// coordinate on the other side of a threshold in rare keys, as for the seed layout.
#[test]
#[ignore = "needs a CUDA device"]
fn whole64_summaries_match_the_reference() {
    let dev = Device::open(0).expect("device");
    let s = setup_with(&dev, whole_geometry());
    let (cfg, geo) = (*s.ix.config(), *s.ix.geometry());
    assert_eq!(s.ix.device_bytes_per_key(), 64);
    assert!(s.ix.download_summaries(0, 0).is_err(), "download_summaries is the seed layout's");
    for seq in 0..geo.batch {
        for h in 0..geo.kv_heads {
            let keys = head_rows(&s.keys[seq], geo.kv_heads, cfg.head_dim, h);
            let (ids, hist, got) = s.ix.download_whole(seq, h).unwrap();
            let seed = Summaries::encode(cfg, &keys).unwrap();
            let want = whole_reference(cfg, &keys, prefill_rows(s.ix.len(seq)));
            assert_eq!(got.n, want.n);
            assert_eq!(got.grid, want.grid, "seq {seq} head {h}: the prefill's weight grid");
            assert_eq!(hist.iter().sum::<u32>(), seed.hist.iter().sum::<u32>());
            let frac = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / b.len() as f64;
            let (ids, codes, weights) = (frac(&ids, &seed.ids), frac(&got.codes, &want.codes), frac(&got.weights, &want.weights));
            let near = got.weights.iter().zip(&want.weights).all(|(a, b)| a.abs_diff(*b) <= 1);
            let (gr, wr) = (got.whole_rows().unwrap(), want.whole_rows().unwrap());
            let rb = 3 * cfg.head_dim / 8;
            let rows = gr.chunks_exact(rb).zip(wr.chunks_exact(rb)).filter(|(a, b)| a == b).count() as f64 / want.n as f64;
            println!("seq {seq} head {h}: ids {ids}, codes {codes}, weight codes {weights}, rows {rows}");
            assert!(ids > 0.999 && codes > 0.999 && weights > 0.999 && rows > 0.99 && near, "seq {seq} head {h}: ids {ids}, codes {codes}, weight codes {weights} (within 1: {near}), rows {rows}");
        }
    }
}

/// Whole64: a kv head's weight grid is fixed by the first append holding one of its keys with a
/// positive weight. An empty append and one whose head-0 keys are all zero leave head 0's grid
/// open (its zero keys code weight 0 on any grid); the next append fixes it, while head 1 keeps
/// the grid of the first append.
#[test]
#[ignore = "needs a CUDA device"]
fn whole64_grid_waits_for_a_positive_key() {
    let dev = Device::open(0).expect("device");
    let cfg = ParisConfig::default_for(128);
    let geo = whole_geometry();
    let (d, hkv) = (cfg.head_dim, geo.kv_heads);
    let mut ix = ParisIndex::new(&dev, cfg, geo).unwrap();
    let mut k = rows(600 * hkv, d, 41, 1.5);
    for r in 0..100 {
        k[r * hkv * d..(r * hkv + 1) * d].fill(f16::ZERO);
    }
    let cut = 100 * hkv * d;
    ix.append(0, &[], &[]).unwrap();
    ix.append(0, &k[..cut], &k[..cut]).unwrap();
    ix.append(0, &k[cut..], &k[cut..]).unwrap();
    for (h, fixed_by) in [(0, 600), (1, 100)] {
        let keys = head_rows(&k, hkv, d, h);
        let (_, _, got) = ix.download_whole(0, h).unwrap();
        let want = whole_reference(cfg, &keys, fixed_by);
        assert_eq!(got.grid, want.grid, "head {h}: the grid of the first append with a positive weight");
        assert_ne!(got.grid.base, -128, "head {h}");
        let same = got.weights.iter().zip(&want.weights).filter(|(a, b)| a == b).count() as f64 / want.n as f64;
        assert!(same > 0.99, "head {h}: weight codes {same}");
        assert_eq!(got.weights[..100].iter().all(|&c| c == 0), h == 0, "head {h}: zero keys, weight code 0");
    }
}

/// The GPU's top-k of every retrieval row against the reference's for the row's queries (per
/// kv head the group's, ranked by `rank`: the summed query's estimate or the largest head
/// estimate; per query head the head's own), and both against the exact top-k the ranking
/// approximates (Recall@100 of the summed logits, or of the largest head logit).
fn check_retrieval(per_query_head: bool, rank: Rank) {
    check_retrieval_with(ParisGeometry { per_query_head, rank, ..geometry() });
}

/// [`check_retrieval`] of `geo` (its summary layout: Whole64's reference reranks with
/// `retrieve_group_compact`, under the layout's default schedule).
fn check_retrieval_with(geo: ParisGeometry) {
    let (per_query_head, rank) = (geo.per_query_head, geo.rank);
    let dev = Device::open(0).expect("device");
    let mut s = setup_with(&dev, geo);
    let (cfg, geo) = (*s.ix.config(), *s.ix.geometry());
    let (d, hq) = (cfg.head_dim, geo.kv_heads * geo.gqa);
    let q = rows(geo.batch * hq, d, 99, 1.0);
    let schedule = Schedule { dense_below: 0, ..s.ix.default_schedule() };
    let k = 100;
    let top = s.ix.retrieve(&q, k, &schedule).unwrap();
    assert_eq!(top.len(), geo.batch * hq);
    // The one-pass top-k (default: split over CTAs at these few rows), the one-pass top-k of
    // one CTA per row and the radix select keep the same set.
    s.ix.set_split_topk(Some(false));
    assert_eq!(s.ix.retrieve(&q, k, &schedule).unwrap(), top, "split vs one-CTA one-pass top-k");
    s.ix.set_split_topk(None);
    // The bucket top-C's two forms keep the same candidates.
    let cand = s.ix.candidates().unwrap();
    for wide in [true, false] {
        s.ix.set_wide_bucket(Some(wide));
        assert_eq!(s.ix.retrieve(&q, k, &schedule).unwrap(), top, "bucket wide {wide}");
        assert_eq!(s.ix.candidates().unwrap(), cand, "bucket wide {wide}: candidates");
    }
    s.ix.set_wide_bucket(None);
    s.ix.set_radix_topk(true);
    assert_eq!(s.ix.retrieve(&q, k, &schedule).unwrap(), top, "one-pass vs radix top-k");
    s.ix.set_radix_topk(false);
    let share = geo.gqa / geo.rows_per_kv_head();
    let (mut agree, mut rec_gpu, mut rec_ref) = (0.0, 0.0, 0.0);
    for seq in 0..geo.batch {
        let n = s.ix.len(seq);
        let plan = schedule.plan(n, k);
        for r in 0..geo.rows_per_sequence() {
            let h = r / geo.rows_per_kv_head();
            let keys = head_rows(&s.keys[seq], geo.kv_heads, d, h);
            let sum = Summaries::encode(cfg, &keys).unwrap();
            let heads: Vec<f64> = q[(seq * hq + r * share) * d..(seq * hq + (r + 1) * share) * d].iter().map(|v| v.to_f64()).collect();
            let cmax = plan.candidates.min(geo.max_candidates);
            let rf = match geo.layout {
                SummaryLayout::Subspace4 => retrieve_group(&sum, &heads, rank, plan.rho, cmax, plan.k).unwrap(),
                SummaryLayout::Whole64 => retrieve_group_compact(&sum, &whole_reference(cfg, &keys, prefill_rows(n)), &heads, rank, plan.rho, cmax, plan.k).unwrap(),
            };
            let want = match rank {
                Rank::Summed => exact_top_k(&keys, &group_query(&heads, d), k),
                Rank::GroupMax => exact_top_k_group_max(&keys, &heads, d, k),
            };
            let got = &top[seq * hq + r * share];
            assert_eq!(got.len(), k);
            for j in 1..share {
                assert_eq!(&top[seq * hq + r * share + j], got, "the query heads of a retrieval row share its top-k");
            }
            agree += recall(got, &rf.indices());
            rec_gpu += recall(got, &want);
            rec_ref += recall(&rf.indices(), &want);
        }
    }
    let rows = (geo.batch * geo.rows_per_sequence()) as f64;
    let (agree, rec_gpu, rec_ref) = (agree / rows, rec_gpu / rows, rec_ref / rows);
    println!("{}, per_query_head {per_query_head}, rank {rank:?}: GPU vs reference {agree:.3}, Recall@{k} GPU {rec_gpu:.3}, reference {rec_ref:.3}", geo.layout.name());
    assert!(agree > 0.95, "GPU vs reference top-k overlap {agree}");
    assert!(rec_gpu > rec_ref - 0.03, "GPU recall {rec_gpu} vs reference {rec_ref}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn retrieval_matches_the_reference() {
    check_retrieval(false, Rank::Summed);
}

/// `rerank_hmax`: the kv head's shared vote and top-C, candidates ranked by the largest of the
/// group's 4 head estimates (fp16 lookup pairs, f32 sums over subspaces) against the f64
/// reference's `retrieve_group_max`.
#[test]
#[ignore = "needs a CUDA device"]
fn retrieval_matches_the_reference_by_group_max() {
    check_retrieval(false, Rank::GroupMax);
}

#[test]
#[ignore = "needs a CUDA device"]
fn retrieval_per_query_head_matches_the_reference() {
    check_retrieval(true, Rank::default());
}

/// Whole64 (`rerank_whole`, `rerank_whole_hmax`; `rerank_whole` also per query head) against
/// `retrieve_group_compact` on the reference's codes.
#[test]
#[ignore = "needs a CUDA device"]
fn whole64_retrieval_matches_the_reference() {
    for (per_query_head, rank) in [(false, Rank::Summed), (false, Rank::GroupMax), (true, Rank::default())] {
        check_retrieval_with(ParisGeometry { per_query_head, rank, ..whole_geometry() });
    }
}

/// Identical keys: every vote score and estimate ties (under either rank: the group-max
/// estimates of identical codes are identical too), so the threshold bin holds every candidate
/// (past the one-pass top-k's shared-memory room: its radix fallback, in the split top-k's last
/// CTA too) and the top-k is the first k keys by index, as in the reference.
#[test]
#[ignore = "needs a CUDA device"]
fn ties_keep_index_order() {
    let dev = Device::open(0).expect("device");
    for (rank, layout) in [(Rank::Summed, SummaryLayout::Subspace4), (Rank::GroupMax, SummaryLayout::Subspace4), (Rank::Summed, SummaryLayout::Whole64), (Rank::GroupMax, SummaryLayout::Whole64)] {
        // 60K keys: 6000 candidates (β 0.10 below 64K keys), more than TIE_CAP (4096).
        let geo = ParisGeometry { capacity: 60_000, rank, layout, ..geometry() };
        let cfg = ParisConfig::default_for(128);
        let mut ix = ParisIndex::new(&dev, cfg, geo).unwrap();
        let one = rows(geo.kv_heads, 128, 5, 1.0);
        let keys: Vec<f16> = (0..60_000).flat_map(|_| one.iter().copied()).collect();
        for seq in 0..geo.batch {
            ix.append(seq, &keys, &keys).unwrap();
        }
        let q = rows(geo.batch * geo.kv_heads * geo.gqa, 128, 6, 1.0);
        let schedule = Schedule { dense_below: 0, ..Schedule::default() };
        let want: Vec<u32> = (0..100).collect();
        for (radix, split, wide) in [(false, Some(true), Some(true)), (false, Some(false), Some(false)), (true, None, None)] {
            ix.set_radix_topk(radix);
            ix.set_split_topk(split);
            ix.set_wide_bucket(wide);
            let top = ix.retrieve(&q, 100, &schedule).unwrap();
            assert!(top.iter().all(|t| *t == want), "rank {rank:?}, layout {layout:?}, radix {radix}, split {split:?}: {:?}", &top[0][..8]);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn attention_matches_f64_over_the_retrieved_rows() {
    let dev = Device::open(0).expect("device");
    let mut s = setup(&dev);
    let (cfg, geo) = (*s.ix.config(), *s.ix.geometry());
    let (d, hq, hkv) = (cfg.head_dim, geo.kv_heads * geo.gqa, geo.kv_heads);
    let q = rows(geo.batch * hq, d, 7, 1.0);
    let top = s.ix.retrieve(&q, 100, &Schedule::default()).unwrap();
    let (staged, lse) = s.ix.attend(&q, false).unwrap();
    let (fused, _) = s.ix.attend(&q, true).unwrap();
    let scale = 1.0 / (d as f64).sqrt();
    for seq in 0..geo.batch {
        for qh in 0..hq {
            let h = qh / geo.gqa;
            let row = |x: &[f16], t: usize| -> Vec<f64> { x[(t * hkv + h) * d..(t * hkv + h + 1) * d].iter().map(|v| v.to_f64()).collect() };
            let mut kv: Vec<(Vec<f64>, Vec<f64>)> = (0..64).map(|t| (row(&s.dense[seq].0, t), row(&s.dense[seq].1, t))).collect();
            kv.extend(top[seq * hq + qh].iter().map(|&t| (row(&s.keys[seq], t as usize), row(&s.values[seq], t as usize))));
            let qv: Vec<f64> = q[(seq * hq + qh) * d..(seq * hq + qh + 1) * d].iter().map(|v| v.to_f64()).collect();
            let logits: Vec<f64> = kv.iter().map(|(k, _)| k.iter().zip(&qv).map(|(a, b)| a * b).sum::<f64>() * scale).collect();
            let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
            let i = seq * hq + qh;
            assert!((f64::from(lse[i]) - (mx + sum.ln())).abs() < 1e-3, "lse ({seq}, {qh})");
            for c in 0..d {
                let want: f64 = kv.iter().zip(&logits).map(|((_, v), l)| (l - mx).exp() / sum * v[c]).sum();
                assert!((f64::from(staged[i * d + c]) - want).abs() < 2e-3, "({seq}, {qh}, {c}): {} vs {want}", staged[i * d + c]);
                assert!((staged[i * d + c] - fused[i * d + c]).abs() < 1e-5, "fused differs at ({seq}, {qh}, {c})");
            }
        }
    }
    let (out, t) = s.ix.step_timed(&q, 100, &Schedule::default()).unwrap();
    assert!(out.iter().zip(&staged).all(|(a, b)| (a - b).abs() < 1e-6));
    // The pipelined step (one span per sequence, fetch and attend on the second stream) gives
    // the same bits as retrieve + attend over the whole batch.
    for chunks in [1, 2] {
        let (piped, piped_lse) = s.ix.step(&q, 100, &Schedule::default(), chunks).unwrap();
        assert_eq!(piped, staged, "pipelined step, {chunks} chunks");
        assert_eq!(piped_lse, lse, "pipelined step lse, {chunks} chunks");
    }
    let (piped, us) = s.ix.step_pipelined_timed(&q, 100, &Schedule::default(), 2).unwrap();
    assert_eq!(piped, staged);
    assert!(us > 0.0);
    assert!(t.vote_us > 0.0 && t.topk_us > 0.0 && t.rerank_us > 0.0 && t.fetch_us > 0.0 && t.attend_us > 0.0, "{t:?}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_budget_is_a_typed_error() {
    let dev = Device::open(0).expect("device");
    let cfg = ParisConfig::default_for(128);
    let small = ParisGeometry { host_budget_bytes: 1 << 20, ..geometry() };
    assert!(matches!(ParisIndex::new(&dev, cfg, small), Err(RtError::HostBudget { .. })));
    // Group-max ranking past the lookup table's 8 heads is refused before anything compiles.
    let wide = ParisGeometry { gqa: 16, rank: Rank::GroupMax, ..geometry() };
    assert!(matches!(ParisIndex::new(&dev, cfg, wide), Err(RtError::BadInput(_))));
    // Whole64 needs m = 8 (its ids are the sign plane's bytes): a typed error, nothing compiled.
    let m4 = ParisConfig { subspaces: 32, ..cfg };
    let err = ParisIndex::new(&dev, m4, whole_geometry()).err().expect("whole64 at m 4 is refused");
    assert!(matches!(err, RtError::Paris(kvforge_paris::ParisError::Layout(_))) && err.is_input_error(), "{err}");
    let mut ix = ParisIndex::new(&dev, cfg, ParisGeometry { capacity: 1000, ..geometry() }).unwrap();
    let k = rows(900 * 2, 128, 1, 0.0);
    ix.append(0, &k, &k).unwrap();
    let err = ix.append(0, &k[..200 * 2 * 128], &k[..200 * 2 * 128]).unwrap_err();
    assert!(matches!(err, RtError::HostBudget { .. }) && err.is_input_error(), "{err}");
    assert_eq!(ix.len(0), 900, "nothing half-offloaded");
}

/// The module compiles through NVRTC for the shapes the tests and benches use (CPU; skipped,
/// visibly, without NVRTC or the CUDA headers, as tests/spec_compiles.rs).
#[test]
fn paris_module_compiles() {
    if !kvforge_rt::nvrtc_present() || kvforge_rt::jit::cuda_include_dir().is_err() {
        assert!(std::env::var("CI").is_err(), "CI needs NVRTC");
        println!("skipped: no NVRTC or CUDA headers");
        return;
    }
    // (256, 8, 6, 2): the largest head dim Whole64 serves.
    for (d, m, t, g) in [(128, 8, 6, 4), (64, 8, 6, 3), (128, 4, 3, 1), (128, 8, 6, 8), (256, 8, 6, 2)] {
        let src = kvforge_gen::render_paris(d, m, t, g).unwrap();
        let name = kvforge_gen::paris_symbol(d, m, t, g);
        for arch in ["sm_90", "sm_80"] {
            kvforge_rt::jit::compile_module(&name, &src, arch, true).unwrap_or_else(|e| panic!("{name} at {arch}: {e}"));
        }
    }
}
