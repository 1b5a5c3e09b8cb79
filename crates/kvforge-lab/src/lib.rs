//! # kvforge-lab: the experiments around the runtime
//!
//! What measures or exercises kvforge rather than serving decode, kept out of the runtime and
//! the controllers so that they carry no benchmark code and no dependency on the f64
//! reference:
//!
//! * [`bench`]: decode and certified-decode timings on the GPU (`kvforge bench`), and
//!   [`fill_for_bench`], the quick batch fill they time;
//! * [`selftest`]: every variant of a spec against the reference (`kvforge selftest`);
//! * [`synth`]: synthetic attention with planted sinks, heavy hitters and needles;
//! * [`frontier`]: attention output error vs bytes of every policy on it (pages coded by
//!   kvforge-ref as the GPU codes them), and the controllers' cost per decode step
//!   (`kvforge frontier`);
//! * [`emit_json`]: how the examples under `examples/` write their result documents.

pub mod bench;
pub mod frontier;
pub mod selftest;
pub mod synth;

pub use bench::fill_for_bench;

/// Writes an example's result document as pretty JSON to `out` (with a final newline), or to
/// stdout without one.
pub fn emit_json(out: Option<&std::path::Path>, doc: &impl serde::Serialize) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(doc)?;
    match out {
        Some(p) => std::fs::write(p, text + "\n"),
        None => {
            println!("{text}");
            Ok(())
        }
    }
}
