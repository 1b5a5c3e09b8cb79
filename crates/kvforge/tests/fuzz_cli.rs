//! The CLI fuzz target (issue 24): argument vectors drawn from the command grammar, with
//! edge values (0, negative, NaN, huge, empty, devices, missing paths) and spec bytes
//! (a small valid spec, mutated, or garbage) under a scratch root. For every case the binary
//! must exit within a bounded time with a documented code (0 ok, 1 failure, 2 bad input,
//! 3 no GPU) and never panic.
//!
//! The scratch root has only `specs/fuzz.toml`, no GPU is visible and NVRTC is hidden, so no
//! case starts real work (`frontier` finds no rdkv spec, `precompile` no NVRTC, `selftest`
//! and `bench` no device). `KVFORGE_FUZZ_CASES` sets the number of cases (default 200).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

fn spec() -> String {
    common::small_spec("fuzz")
}

/// A case's time limit: far above what any refusal takes, far below a hang.
const LIMIT: Duration = Duration::from_secs(30);

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "1",
            "-1",
            "8",
            "64",
            "512",
            "4096",
            "nan",
            "inf",
            "-0.5",
            "0.5",
            "1e30",
            "99999999999999999999999",
            "",
            "zzz",
            "1,2",
            "0,1",
            ",",
            "sm_90",
            "sm_",
            "rdkv:b4",
            "rdkv:b8+b4",
            "a:b",
            "codebook",
            "isotropic"
        ])
        .prop_map(String::from),
        prop::sample::select(vec!["/dev/zero", "/dev/urandom", "/nonexistent/x", "specs", "specs/fuzz.toml", "out/x.json", "x.json"]).prop_map(String::from),
        "[ -~]{0,12}",
    ]
}

fn flag_for(cmd: &str) -> Vec<&'static str> {
    match cmd {
        "frontier" => vec![
            "--contexts",
            "--kv-heads",
            "--seeds",
            "--budgets",
            "--keys",
            "--timing-context",
            "--timing-kv-heads",
            "--gpu-steps",
            "--gpu-every",
            "--rdr-window",
            "--rdr-sample",
            "--decode-queries",
            "--json",
            "--decode-json",
        ],
        "bench" => vec!["--tiers", "--ladders", "--contexts", "--batches", "--runs", "--head-dim", "--q-heads", "--kv-heads", "--max-gib", "--json", "--steps"],
        "selftest" => vec!["--filter", "--json", "--date"],
        "precompile" => vec!["--arch", "--report", "--jobs", "--only"],
        "train" => vec!["--samples", "--tensor", "--group", "--angle-bits", "--seed", "--iters", "--uniform", "--out"],
        _ => vec![],
    }
}

fn switches(cmd: &str) -> Vec<&'static str> {
    match cmd {
        "frontier" => vec!["--no-timing", "--gpu", "--no-frontier"],
        "bench" => vec!["--certified", "--rank-report-only", "--allow-no-gpu"],
        "selftest" => vec!["--long", "--allow-no-gpu"],
        "precompile" => vec!["--strict", "--no-cache"],
        _ => vec![],
    }
}

fn argv() -> impl Strategy<Value = Vec<String>> {
    let cmd = prop::sample::select(vec!["list", "check", "generate", "precompile", "selftest", "bench", "frontier", "probe", "train", "--help", "--version", "bogus"]);
    (cmd, prop::collection::vec((any::<prop::sample::Index>(), value(), any::<bool>()), 0..5), prop::collection::vec(value(), 0..2)).prop_map(|(cmd, flags, positional)| {
        let mut v: Vec<String> = if cmd == "train" { vec!["codebook".into(), "train".into()] } else { vec![cmd.into()] };
        let (fl, sw) = (flag_for(cmd), switches(cmd));
        for (i, val, switch) in flags {
            if switch && !sw.is_empty() {
                v.push(sw[i.index(sw.len())].into());
            } else if !fl.is_empty() {
                // Both spellings: `--flag value` and `--flag=value` (negative numbers need it).
                let f = fl[i.index(fl.len())];
                if val.starts_with('-') {
                    v.push(format!("{f}={val}"));
                } else {
                    v.push(f.into());
                    v.push(val);
                }
            }
        }
        if ["list", "check", "precompile", "selftest"].contains(&cmd) {
            v.extend(positional.into_iter().filter(|p| !p.starts_with('-')));
        }
        v
    })
}

fn spec_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => Just(spec().into_bytes()),
        3 => (prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4)).prop_map(|edits| {
            let mut b = spec().into_bytes();
            for (i, x) in edits {
                let at = i.index(b.len());
                b[at] = x;
            }
            b
        }),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

fn run_case(dir: &Path, args: &[String], spec: &[u8]) -> Result<(), TestCaseError> {
    std::fs::create_dir_all(dir.join("specs")).unwrap();
    std::fs::write(dir.join("specs/fuzz.toml"), spec).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvforge"))
        .args(args)
        .current_dir(dir)
        .env("CUDA_VISIBLE_DEVICES", "")
        .env("LD_LIBRARY_PATH", "")
        .env_remove("KVFORGE_CUDA_INCLUDE")
        .env("KVFORGE_CACHE_DIR", dir.join("cache"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvforge runs");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > LIMIT {
            child.kill().ok();
            child.wait().ok();
            return Err(TestCaseError::fail(format!("kvforge {args:?} ran past {LIMIT:?}")));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code();
    prop_assert!(matches!(code, Some(0..=3)), "kvforge {:?}: exit {:?}\nspec: {:?}\nstderr: {}", args, out.status, String::from_utf8_lossy(spec), err);
    prop_assert!(!err.contains("panicked"), "kvforge {:?} panicked\nspec: {:?}\nstderr: {}", args, String::from_utf8_lossy(spec), err);
    Ok(())
}

#[test]
fn cli_never_panics_or_hangs_and_exits_with_a_documented_code() {
    let cases: u32 = std::env::var("KVFORGE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let dir = std::env::temp_dir().join(format!("kvforge-fuzz-cli-{}", std::process::id()));
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, max_shrink_iters: 32, ..Config::default() });
    let result = runner.run(&(argv(), spec_bytes()), |(args, spec)| run_case(&dir, &args, &spec));
    std::fs::remove_dir_all(&dir).ok();
    if let Err(e) = result {
        panic!("{e}");
    }
}
