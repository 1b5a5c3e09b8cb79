//! One rule, on every CI run: **a spec that the validator accepts compiles.** Draws specs from
//! the spec grammar (every key and value scheme, page size, head dim, GQA, kernel option),
//! and for each one `Spec::parse` accepts, renders a sample of its kernels (one decode module,
//! one other) and compiles them with NVRTC. A kernel `static_assert` that a valid spec trips
//! belongs in `kvforge_spec::constraints` (a located error) or must be fixed in the kernel.
//!
//! Cost: `KVFORGE_SPEC_CASES` accepted specs (default 4) × 2 kernels. Needs NVRTC
//! (`LD_LIBRARY_PATH`, `KVFORGE_CUDA_INCLUDE`, as `.ci/run` sets them): without it the test
//! fails under CI (`CI` set) and is skipped, visibly, elsewhere.

use kvforge_rt::jit::{compile, CompileMode};
use kvforge_spec::{Family, Spec};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

#[derive(Clone, Debug)]
enum Key {
    Dense(&'static str),
    Int {
        bits: u32,
        block_shift: u32,
        scale: &'static str,
    },
    Mixed {
        channels: &'static str,
        block_shift: u32,
    },
    /// group, angle bits, shipped codebook.
    Spherical(usize, u32, &'static str),
    Drop,
}

#[derive(Clone, Debug)]
enum Value {
    Dense(&'static str),
    Int { bits: u32, group: usize, scale: &'static str },
}

#[derive(Clone, Debug)]
struct Draw {
    head_dims: Vec<usize>,
    gqa: usize,
    tokens: usize,
    warps: usize,
    dense_warps: Option<usize>,
    tensor_core_values: bool,
    certified: bool,
    split_k: bool,
    ctas_per_sm: Option<usize>,
    stage_kib: Option<usize>,
    tiers: Vec<(Key, Value)>,
    /// Which decode module and which other kernel to compile.
    pick: (usize, usize),
}

fn key() -> impl Strategy<Value = Key> {
    prop_oneof![
        prop::sample::select(vec!["fp16", "bf16"]).prop_map(Key::Dense),
        (prop::sample::select(vec![8u32, 4, 2]), 0u32..4, prop::sample::select(vec!["fp16", "fp32"])).prop_map(|(bits, block_shift, scale)| Key::Int { bits, block_shift, scale }),
        (prop::sample::select(vec!["{ 16 = 0.125, 8 = 0.25, 4 = 0.375, 2 = 0.125 }", "{ 8 = 0.5, 4 = 0.5 }", "{ 4 = 0.25, 2 = 0.5 }"]), 0u32..4)
            .prop_map(|(channels, block_shift)| Key::Mixed { channels, block_shift }),
        prop::sample::select(vec![(16, 6, "sph_g16_b6"), (16, 4, "sph_g16_b4"), (32, 3, "sph_g32_b3")]).prop_map(|(g, a, c)| Key::Spherical(g, a, c)),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec!["fp16", "bf16"]).prop_map(Value::Dense),
        (prop::sample::select(vec![8u32, 4, 2]), prop::sample::select(vec![8usize, 16, 32, 64]), prop::sample::select(vec!["fp16", "fp32"])).prop_map(|(bits, group, scale)| Value::Int { bits, group, scale }),
    ]
}

fn draw() -> impl Strategy<Value = Draw> {
    (
        (prop::sample::subsequence(vec![64usize, 128, 256], 1..=2), prop::sample::select(vec![1usize, 2, 3, 4, 6, 8]), prop::sample::select(vec![16usize, 32, 64, 128])),
        (prop::sample::select(vec![4usize, 8]), prop::option::of(prop::sample::select(vec![4usize, 8])), any::<bool>(), prop::bool::weighted(0.3), any::<bool>()),
        (prop::collection::vec((key(), value()), 1..=2), any::<bool>()),
        (any::<usize>(), any::<usize>()),
        (prop::option::weighted(0.3, 1usize..=4), prop::option::weighted(0.3, prop::sample::select(vec![8usize, 16, 32, 48, 64, 100, 200]))),
    )
        .prop_map(|((head_dims, gqa, tokens), (warps, dense_warps, tensor_core_values, certified, split_k), (mut tiers, drop), pick, (ctas_per_sm, stage_kib))| {
            if drop {
                tiers.push((Key::Drop, Value::Dense("drop")));
            }
            Draw { head_dims, gqa, tokens, warps, dense_warps, tensor_core_values, certified, split_k, ctas_per_sm, stage_kib, tiers, pick }
        })
}

fn toml(d: &Draw) -> String {
    let dims: Vec<String> = d.head_dims.iter().map(|x| x.to_string()).collect();
    let mut s = format!("[spec]\nname = \"drawn\"\n\n[geometry]\nhead_dims = [{}]\ngqa = [{}]\n\n[page]\ntokens = {}\n\n", dims.join(", "), d.gqa, d.tokens);
    for (i, (k, v)) in d.tiers.iter().enumerate() {
        let key = match k {
            Key::Dense(t) => format!("{{ scheme = \"{t}\" }}"),
            Key::Int { bits, block_shift, scale } => format!("{{ scheme = \"int\", bits = {bits}, block = {}, scale_dtype = \"{scale}\" }}", d.tokens >> block_shift),
            Key::Mixed { channels, block_shift } => format!("{{ scheme = \"mixed\", channels = {channels}, block = {} }}", d.tokens >> block_shift),
            Key::Spherical(g, a, c) => format!("{{ scheme = \"spherical\", group = {g}, angle_bits = {a}, codebook = \"../codebooks/{c}.safetensors\" }}"),
            Key::Drop => "{ scheme = \"drop\" }".into(),
        };
        let value = match (k, v) {
            (Key::Drop, _) => "{ scheme = \"drop\" }".into(),
            (_, Value::Dense(t)) => format!("{{ scheme = \"{t}\" }}"),
            (_, Value::Int { bits, group, scale }) => format!("{{ scheme = \"int\", bits = {bits}, group = {group}, scale_dtype = \"{scale}\" }}"),
        };
        s += &format!("[[tier]]\nname = \"t{i}\"\nkey = {key}\nvalue = {value}\n\n");
    }
    s += &format!("[kernels]\nwarps = {}\ntensor_core_values = {}\ncertified = {}\nsplit_k = {}\n", d.warps, d.tensor_core_values, d.certified, d.split_k);
    if let Some(w) = d.dense_warps {
        s += &format!("dense = {{ warps = {w} }}\n");
    }
    if let Some(c) = d.ctas_per_sm {
        s += &format!("ctas_per_sm = {c}\n");
    }
    if let Some(k) = d.stage_kib {
        s += &format!("stage_kib = {k}\n");
    }
    s
}

/// Dynamic shared memory one CTA may have (sm_90): a kernel that asks for more compiles but
/// cannot launch.
const MAX_SMEM_PER_CTA: usize = 227 * 1024;

/// The CPU half of the rule, over many more specs (no NVRTC): every kernel of a spec that
/// `kvforge check` accepts (`Spec::parse`, then `kvforge_gen::limits::check`) fits one CTA's
/// shared memory. The limit is restated here, not imported, so that the test checks it.
#[test]
fn every_accepted_spec_fits_shared_memory() {
    let specs_dir = kvforge_rt::testing::repo_root().join("specs");
    let mut runner = TestRunner::new(Config { cases: 512, max_shrink_iters: 0, failure_persistence: None, ..Config::default() });
    let accepted = std::cell::Cell::new(0usize);
    runner
        .run(&draw(), |d| {
            let src = toml(&d);
            let Ok(spec) = Spec::parse(&src, "drawn.toml", &specs_dir) else { return Ok(()) };
            // What `kvforge check` refuses besides the fields: the schedule's device limits.
            if kvforge_gen::limits::check(&spec).is_err() {
                return Ok(());
            }
            accepted.set(accepted.get() + 1);
            for v in kvforge_gen::variants(&spec).into_iter().chain(spec.certify_variants()) {
                let sh = kvforge_gen::launch_shape(&spec, &v);
                let most = sh.smem_bytes.max(sh.certified_smem_bytes);
                prop_assert!(most <= MAX_SMEM_PER_CTA, "{v}: {most} B of shared memory, more than {MAX_SMEM_PER_CTA}\n--- spec\n{src}");
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    println!("{} of 512 drawn specs accepted", accepted.get());
    assert!(accepted.get() >= 32, "the grammar drew too few valid specs: {}", accepted.get());
}

#[test]
fn every_accepted_spec_compiles() {
    if !kvforge_rt::nvrtc_present() || kvforge_rt::jit::cuda_include_dir().is_err() {
        assert!(std::env::var_os("CI").is_none(), "CI needs NVRTC and KVFORGE_CUDA_INCLUDE for the compile property test (see .ci/run)");
        println!("skipped: no NVRTC or CUDA headers (set LD_LIBRARY_PATH and KVFORGE_CUDA_INCLUDE)");
        return;
    }
    let wanted: usize = std::env::var("KVFORGE_SPEC_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(4);
    let specs_dir = kvforge_rt::testing::repo_root().join("specs");
    let mode = CompileMode { strict: false, ptxas_report: false, use_cache: false };
    // Draw until `wanted` specs validate: the grammar also yields specs the validator rightly
    // refuses (ladders out of order, blocks that do not divide the page), which cost nothing.
    let mut runner = TestRunner::new(Config { cases: 64 * wanted as u32, max_shrink_iters: 0, failure_persistence: None, ..Config::default() });
    let accepted = std::cell::Cell::new(0usize);
    let result = runner.run(&draw(), |d| {
        if accepted.get() >= wanted {
            return Ok(());
        }
        let src = toml(&d);
        let Ok(spec) = Spec::parse(&src, "drawn.toml", &specs_dir) else { return Ok(()) };
        if kvforge_gen::limits::check(&spec).is_err() {
            return Ok(());
        }
        accepted.set(accepted.get() + 1);
        let all: Vec<_> = kvforge_gen::variants(&spec).into_iter().chain(spec.certify_variants()).collect();
        let decode: Vec<_> = all.iter().filter(|v| matches!(v.family, Family::Decode { .. })).collect();
        // Transcodes (the encoders' asserts) where the spec has any, else combine / mass window.
        let transcode: Vec<_> = all.iter().filter(|v| matches!(v.family, Family::Transcode { .. })).collect();
        let other: Vec<_> = if transcode.is_empty() { all.iter().filter(|v| !matches!(v.family, Family::Decode { .. })).collect() } else { transcode };
        let sample = [decode[d.pick.0 % decode.len()], other[d.pick.1 % other.len()]];
        for v in sample {
            let code = kvforge_gen::render(&spec, v).map_err(|e| TestCaseError::fail(format!("{v}: render: {e}\n--- spec\n{src}")))?;
            let t = std::time::Instant::now();
            compile(v, &code, "sm_90", mode).map_err(|e| TestCaseError::fail(format!("{v}: a spec the validator accepts does not compile:\n{e}\n--- spec\n{src}")))?;
            println!("{v}: compiled in {:.1} s", t.elapsed().as_secs_f64());
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    assert_eq!(accepted.get(), wanted, "the grammar drew too few valid specs");
}
