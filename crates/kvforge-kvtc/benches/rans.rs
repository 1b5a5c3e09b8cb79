//! Host speed of the `rans` coder on a step allocation (the restore's host stage): one chunk
//! of 256 tokens of Gaussian components with a decaying spectrum, about SmolLM2's kept
//! components at 16–20×. `cargo bench -p kvforge-kvtc --bench rans`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvforge_kvtc::{model, pack, step};
use rand::{Rng, SeedableRng};

fn bench(c: &mut Criterion) {
    let (rows, comps, n) = (512, 2048, 256);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let sd: Vec<f64> = (0..comps).map(|j| 10.0 / (1.0 + j as f64).powf(0.5)).collect();
    let gauss = |rng: &mut rand_chacha::ChaCha8Rng| (0..12).map(|_| rng.gen_range(-0.5..0.5)).sum::<f64>();
    let data: Vec<f64> = (0..rows * comps).map(|k| gauss(&mut rng) * sd[k % comps]).collect();
    let alloc = step::allocation(&data, rows, comps, &sd, 2 * comps, &[], 0.0);
    let chunk: Vec<f64> = (0..n * comps).map(|k| gauss(&mut rng) * sd[k % comps]).collect();
    let raw = pack::encode(&chunk, n, comps, &alloc);
    let stored = model::encode(&raw, n, &alloc).unwrap();
    let symbols = n * alloc.groups.iter().map(|g| g.len as usize).sum::<usize>();
    let mut g = c.benchmark_group("rans");
    g.throughput(Throughput::Elements(symbols as u64));
    g.bench_function("encode", |b| b.iter(|| model::encode(&raw, n, &alloc).unwrap()));
    let mut out = vec![0u8; raw.len()];
    g.bench_function("decode", |b| b.iter(|| model::decode_into(&stored, n, &alloc, &mut out).unwrap()));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
