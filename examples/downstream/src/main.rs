//! What a downstream crate writes: no build script, no generated files, only the macros.
//!
//! `cargo run -p kvforge-example-downstream`

use kvforge_macros::KvTier;

/// Every kernel of `specs/spherical.toml`, sources embedded (the path resolves against this
/// crate, then its parents: here, the workspace root).
mod spherical {
    kvforge_macros::kernels!("specs/spherical.toml");
}

/// A custom tier, checked by the spec validator when this crate compiles: int4 keys per
/// channel in blocks of 32 tokens with fp32 scales, int8 values in groups of 32 channels.
#[derive(KvTier)]
#[kv(name = "k4v8", head_dim = 128, page = 64)]
#[kv(key = "int", key_bits = 4, key_block = 32, key_scale_dtype = "fp32")]
#[kv(value = "int", value_bits = 8, value_group = 32)]
struct K4V8;

// Layout facts are consts: a tier that got too big fails the build here.
const _: () = assert!(K4V8::BYTES_PER_TOKEN < spherical::tiers::tail::d128::BYTES_PER_TOKEN);

fn main() {
    println!("spec `{}` ({}, hash {}), {}-token pages", spherical::SPEC_NAME, spherical::SPEC_PATH, spherical::SPEC_HASH, spherical::PAGE_TOKENS);
    println!(
        "tiers at head_dim 128: high {} B/token, mid {} B/token, low {} B/token",
        spherical::tiers::high::d128::BYTES_PER_TOKEN,
        spherical::tiers::mid::d128::BYTES_PER_TOKEN,
        spherical::tiers::low::d128::BYTES_PER_TOKEN,
    );
    println!("{} kernel variants:", spherical::Variant::ALL.len());
    for v in spherical::Variant::ALL {
        let info = v.info();
        let first = info.source.lines().next().unwrap_or("");
        println!("  {:<60} {:>4} threads {:>6} B smem  {}", info.name, info.threads, info.smem_bytes, first);
    }

    println!();
    println!("custom tier `{}` ({}):", K4V8::NAME, K4V8::TIER_CODE);
    println!(
        "  {} B/token/head at head_dim {}, segment {} B, page {} B (K codes at +{}, V codes at +{})",
        K4V8::BYTES_PER_TOKEN,
        K4V8::HEAD_DIM,
        K4V8::SEGMENT_BYTES,
        K4V8::PAGE_BYTES,
        K4V8::K_CODES_OFFSET,
        K4V8::V_CODES_OFFSET
    );
    println!("  as a spec:\n");
    for line in K4V8::spec_toml().lines() {
        println!("{}", format!("    {line}").trim_end());
    }
}
