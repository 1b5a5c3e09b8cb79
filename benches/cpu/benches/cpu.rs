//! CPU-side costs that sit on the serving path or the developer loop: parsing and validating
//! a spec (codebooks included), rendering every kernel of a spec, and planning a decode batch
//! (page table + variant + split choice) for 64 sequences × 8 kv heads × 32K tokens.

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use kvforge_rt::{plan, PageRef};
use kvforge_spec::Spec;

fn spec_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../specs").join(name)
}

fn bench(c: &mut Criterion) {
    let src = std::fs::read_to_string(spec_path("spherical.toml")).unwrap();
    let dir = spec_path("");
    c.bench_function("parse+validate specs/spherical.toml", |b| b.iter(|| Spec::parse(&src, "specs/spherical.toml", &dir).unwrap()));
    let spec = Spec::load(&spec_path("spherical.toml")).unwrap();
    c.bench_function("render every kernel of spherical.toml", |b| b.iter(|| kvforge_gen::render_spec(&spec).unwrap()));
    let pages: Vec<Vec<Vec<(PageRef, usize)>>> =
        (0..64u64).map(|s| (0..8u64).map(|h| (0..512u64).map(|i| (PageRef { tier: 1 + (i % 3) as u8, index: 0, offset: (s * 8 + h) * 1_000_000 + i * 20_000 }, 64)).collect()).collect()).collect();
    c.bench_function("plan decode 64 seq x 8 heads x 32K tokens", |b| b.iter(|| plan(&spec, 128, 4, &pages, &|_| 17408, &|_| 264).unwrap()));
}

criterion_group!(benches, bench);
criterion_main!(benches);
