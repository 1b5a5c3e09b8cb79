//! Issue 24: every input kvforge accepts works, and every one it refuses says why, with the
//! documented exit code (0 ok, 1 failure, 2 bad input, 3 no GPU) and before any work. Runs
//! the built binary.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `kvforge args...` from the repository root with no GPU visible; panics after
/// `limit` (a hang is a failure, not a wait).
fn kvforge_in(dir: &Path, args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvforge"))
        .args(args)
        .current_dir(dir)
        .env("CUDA_VISIBLE_DEVICES", "")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvforge runs");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().ok();
            panic!("kvforge {args:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn kvforge(args: &[&str]) -> Output {
    kvforge_in(&root(), args, Duration::from_secs(60))
}

/// Asserts the exit code and that stderr says each of `says`; returns stderr.
#[track_caller]
fn expect(out: &Output, code: i32, says: &[&str]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(code), "stdout:\n{stdout}\nstderr:\n{err}");
    for s in says {
        assert!(err.contains(s), "stderr should say {s:?}:\n{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvforge-inputs-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn small() -> String {
    common::small_spec("small")
}

// Point 7: `kvforge check FILE` validates.
#[test]
fn check_validates_the_files_it_is_given() {
    let d = temp("check");
    let good = d.join("good.toml");
    std::fs::write(&good, small()).unwrap();
    let out = kvforge(&["check", good.to_str().unwrap()]);
    expect(&out, 0, &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok"), "{out:?}");
    let bad = d.join("bad.toml");
    std::fs::write(&bad, small().replace("tokens = 32", "tokens = 33")).unwrap();
    expect(&kvforge(&["check", good.to_str().unwrap(), bad.to_str().unwrap()]), 2, &["bad.toml:9:10", "page.tokens", "valid: 16, 32, 64, 128"]);
}

// Point 1: a spec that the kernels cannot compile is refused by `check`, located.
#[test]
fn check_refuses_specs_whose_kernels_do_not_compile() {
    let d = temp("compile");
    let f = d.join("p16.toml");
    std::fs::write(&f, small().replace("tokens = 32", "tokens = 16").replace("block = 32", "block = 16")).unwrap();
    expect(&kvforge(&["check", f.to_str().unwrap()]), 2, &["p16.toml:9:10", "`page.tokens`", "head_dim 64", "tensor-core value tiles", "kernels.warps` = 4"]);
    std::fs::write(&f, small().replace("tokens = 32", "tokens = 128").replace("block = 32", "block = 128")).unwrap();
    expect(&kvforge(&["check", f.to_str().unwrap()]), 2, &["`page.tokens`", "valid page.tokens at head_dim 64: 32, 64"]);
}

// Point 1: a spec whose decode cannot get its shared memory is refused by `check` too.
#[test]
fn check_refuses_specs_over_the_shared_memory_of_a_cta() {
    let d = temp("smem");
    let f = d.join("big.toml");
    let spec = r#"[spec]
name = "big"

[geometry]
head_dims = [256]
gqa = [6]

[page]
tokens = 128

[[tier]]
name = "t0"
key = { scheme = "int", bits = 4, block = 32 }
value = { scheme = "bf16" }

[[tier]]
name = "t1"
key = { scheme = "spherical", group = 16, angle_bits = 6, codebook = "CB" }
value = { scheme = "fp16" }

[kernels]
tensor_core_values = false
"#
    .replace("CB", root().join("codebooks/sph_g16_b6.safetensors").to_str().unwrap());
    std::fs::write(&f, spec).unwrap();
    expect(&kvforge(&["check", f.to_str().unwrap()]), 2, &["big.toml", "kernels.combinations", "B of shared memory per CTA", "fewer page.tokens"]);
}

// Point 2: `frontier --contexts 0` panicked in synth.rs.
#[test]
fn frontier_contexts_too_short_are_bad_input() {
    for c in ["0", "100"] {
        expect(&kvforge(&["frontier", "--contexts", c, "--no-timing"]), 2, &[&format!("--contexts {c}"), "at least 512 tokens"]);
    }
}

// Point 9: frontier's other nonsense.
#[test]
fn frontier_refuses_nonsense_before_work() {
    expect(&kvforge(&["frontier", "--kv-heads", "0"]), 2, &["--kv-heads 0"]);
    expect(&kvforge(&["frontier", "--budgets=-1"]), 2, &["--budgets -1"]);
    expect(&kvforge(&["frontier", "--budgets", "nan"]), 2, &["--budgets NaN"]);
    expect(&kvforge(&["frontier", "--timing-context", "0"]), 2, &["--timing-context 0"]);
    expect(&kvforge(&["frontier", "--json", "/nonexistent-dir/x.json"]), 2, &["--json /nonexistent-dir/x.json", "does not exist"]);
}

fn gpu_present() -> bool {
    kvforge_rt::Device::open(0).is_ok()
}

// Points 3 and 9: without a GPU, GPU commands exit 3 (and print no stored figures).
#[test]
fn gpu_commands_without_a_gpu_exit_3() {
    if gpu_present() {
        println!("skipped: a GPU is present");
        return;
    }
    expect(&kvforge(&["selftest"]), 3, &["no GPU", "--allow-no-gpu"]);
    let out = kvforge(&["selftest", "--allow-no-gpu"]);
    expect(&out, 0, &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("skipped: no GPU"));
    expect(&kvforge(&["bench", "--tiers", "rdkv:b4"]), 3, &["no GPU"]);
    expect(&kvforge(&["bench", "--tiers", "rdkv:b4", "--allow-no-gpu"]), 0, &[]);
    expect(&kvforge(&["probe"]), 3, &[]);
    let out = kvforge(&["frontier", "--gpu", "--no-frontier"]);
    expect(&out, 3, &["no GPU"]);
    assert!(out.stdout.is_empty(), "nothing printed before the GPU check: {}", String::from_utf8_lossy(&out.stdout));
}

// Point 9: a filter that matches nothing is bad input.
#[test]
fn filters_that_match_nothing_are_bad_input() {
    expect(&kvforge(&["precompile", "--only", "zzz"]), 2, &["--only zzz", "no variant"]);
    expect(&kvforge(&["selftest", "--filter", "zzz"]), 2, &["--filter zzz"]);
    expect(&kvforge(&["selftest", "--jobs", "0"]), 2, &["--jobs 0"]);
    expect(&kvforge(&["bench", "--tiers", "rdkv:zzz"]), 2, &["--tiers rdkv:zzz"]);
    expect(&kvforge(&["precompile", "--arch", "90"]), 2, &["--arch 90"]);
}

// Point 4: spec paths that are not regular files, or too large.
#[test]
fn spec_inputs_must_be_small_regular_files() {
    for dev in ["/dev/urandom", "/dev/zero"] {
        if Path::new(dev).exists() {
            let out = kvforge_in(&root(), &["list", dev], Duration::from_secs(20));
            expect(&out, 2, &[dev, "not a regular file"]);
            expect(&kvforge_in(&root(), &["check", dev], Duration::from_secs(20)), 2, &["not a regular file"]);
        }
    }
    let d = temp("big");
    let big = d.join("big.toml");
    std::fs::write(&big, "#".repeat(2 << 20)).unwrap();
    expect(&kvforge(&["check", big.to_str().unwrap()]), 2, &["more than the limit"]);
    expect(&kvforge(&["check", d.to_str().unwrap()]), 2, &["not a regular file"]);
}

// Point 8: codebook arguments blame the right flag, and the output directory is checked first.
#[test]
fn codebook_train_names_the_bad_argument() {
    let err = expect(&kvforge(&["codebook", "train", "--group", "0", "--angle-bits", "4", "--out", "/tmp/x.safetensors"]), 2, &["--group 0"]);
    assert!(!err.contains("angle"), "{err}");
    expect(&kvforge(&["codebook", "train", "--group", "16", "--angle-bits", "9", "--out", "/tmp/x.safetensors"]), 2, &["--angle-bits 9"]);
    let start = Instant::now();
    expect(&kvforge(&["codebook", "train", "--group", "16", "--angle-bits", "8", "--out", "/nonexistent-dir/cb.safetensors"]), 2, &["--out /nonexistent-dir/cb.safetensors", "does not exist"]);
    assert!(start.elapsed() < Duration::from_secs(10), "checked before training");
    expect(&kvforge(&["codebook", "train", "--group", "16", "--angle-bits", "4", "--samples", "/dev/zero", "--out", "/tmp/x.safetensors"]), 2, &["--samples /dev/zero", "not a regular file"]);
}

// Point 8: spec messages that leaked internals.
#[test]
fn spec_messages_say_what_a_user_wrote() {
    let d = temp("messages");
    let f = d.join("m.toml");
    std::fs::write(&f, small().replace(r#"key = { scheme = "int", bits = 8, block = 32 }"#, r#"key = "fp16""#)).unwrap();
    let err = expect(&kvforge(&["check", f.to_str().unwrap()]), 2, &["tier[0].key", "a scheme is a table like { scheme = \"fp16\" }"]);
    assert!(!err.contains("RawScheme"), "{err}");
    std::fs::write(&f, small().replace("tokens = 32", "tokens = 100000000000000000000000")).unwrap();
    let err = expect(&kvforge(&["check", f.to_str().unwrap()]), 2, &["m.toml:9:"]);
    assert!(!err.contains("i128"), "{err}");
    std::fs::write(&f, format!("{}\nx = {}{}\n", small(), "[".repeat(100_000), "]".repeat(100_000))).unwrap();
    let err = expect(&kvforge(&["check", f.to_str().unwrap()]), 2, &["m.toml:"]);
    assert!(err.len() < 2000, "a short message, not {} bytes", err.len());
}

// Point 8: every bad input is exit 2, whichever command reads it; the table is in --help.
#[test]
fn exit_codes_are_documented_and_uniform() {
    let out = kvforge(&["--help"]);
    expect(&out, 0, &[]);
    let help = String::from_utf8_lossy(&out.stdout);
    for s in ["Exit codes", "0 success", "1 failure", "2 bad input", "3 no GPU"] {
        assert!(help.contains(s), "--help should say {s:?}:\n{help}");
    }
    let missing = "/nonexistent/spec.toml";
    for cmd in ["list", "check", "precompile", "selftest"] {
        expect(&kvforge(&[cmd, missing]), 2, &[missing]);
    }
    expect(&kvforge(&["bench", "--ladders", "b8+b4"]), 2, &[]);
    expect(&kvforge(&["frontier", "--keys", "zzz"]), 2, &["--keys zzz"]);
    expect(&kvforge(&["--no-such-flag"]), 2, &[]);
}

// Point 6: the Python scripts say what to do when their python is missing (and make the
// venv themselves when none is given: see the scripts).
#[test]
fn python_scripts_check_their_python_first() {
    for script in ["crates/kvforge-py/ci.sh", "crates/kvforge-py/build-wheel.sh"] {
        let out = Command::new("bash").arg(root().join(script)).arg("/nonexistent/python").output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{script}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/python is not an executable python"), "{script}: {out:?}");
        // The venv is made by the python-env.sh both scripts source.
        let text = std::fs::read_to_string(root().join(script)).unwrap();
        let env = std::fs::read_to_string(root().join("crates/kvforge-py/python-env.sh")).unwrap();
        assert!(text.contains("source \"$(dirname \"$0\")/python-env.sh\"") && env.contains("python3 -m venv"), "{script} creates the venv a fresh clone lacks");
    }
}
