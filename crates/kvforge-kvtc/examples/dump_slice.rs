//! Tokens `from..to` of a K/V dump as a dump of their own: splits a capture into a
//! calibration part and a held-out part (the rate check of a held-out window of the
//! calibration text).
//!
//! `cargo run --release -p kvforge-kvtc --example dump_slice -- <dump> <out> <from> <to>`

use std::collections::HashMap;

use kvforge_kvtc::KvDump;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: dump_slice <dump.safetensors> <out.safetensors> <from> <to>");
        std::process::exit(2);
    }
    let (d, meta) = KvDump::load_with_metadata(args[1].as_ref()).unwrap_or_else(|e| panic!("{}: {e}", args[1]));
    let (from, to): (usize, usize) = (args[3].parse().expect("from"), args[4].parse().expect("to"));
    assert!(from < to && to <= d.tokens, "{from}..{to} is not inside {} tokens", d.tokens);
    let n = to - from;
    let pick = |x: &[f32]| -> Vec<f32> { (0..d.layers * d.kv_heads).flat_map(|lh| x[(lh * d.tokens + from) * d.head_dim..(lh * d.tokens + to) * d.head_dim].iter().copied()).collect() };
    let out = KvDump { tokens: n, positions: d.positions[from..to].to_vec(), k: pick(&d.k), v: pick(&d.v), ..d.clone() };
    let meta: HashMap<String, String> = meta;
    out.save(args[2].as_ref(), meta).unwrap_or_else(|e| panic!("{}: {e}", args[2]));
}
