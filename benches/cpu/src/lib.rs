//! Criterion benches live in `benches/cpu.rs`.
