use kvforge_macros::KvTier;

#[derive(KvTier)]
#[kv(key = "fp16", value = "fp16")]
struct Dense;

#[derive(KvTier)]
#[kv(key = "bf16", value = "bf16", dtype = "bf16", head_dim = 256)]
struct DenseBf16;

/// Seed 000's "High" tier; the codebook resolves like `kernels!`'s spec (walking up to the
/// workspace's codebooks/).
#[derive(KvTier)]
#[kv(key = "spherical", key_group = 16, angle_bits = 6, radius_bits = 8, codebook = "codebooks/sph_g16_b6.safetensors")]
#[kv(value = "fp16")]
enum SphericalHigh {}

fn main() {
    assert_eq!(Dense::NAME, "dense");
    assert_eq!(Dense::TIER_CODE, "kfp16_vfp16");
    assert_eq!(Dense::BYTES_PER_TOKEN, 512.0);
    assert_eq!(Dense::K_OFFSET, 0);
    assert_eq!(Dense::V_OFFSET, 16384);
    assert_eq!(Dense::PAGE_BYTES, 32896);

    assert_eq!(DenseBf16::NAME, "dense_bf16");
    assert_eq!(DenseBf16::TIER_CODE, "kbf16_vbf16");
    assert_eq!(DenseBf16::BYTES_PER_TOKEN, 1024.0);

    // 8 groups: 8 B of radii + 6 B of indices, then fp16 values.
    assert_eq!(SphericalHigh::NAME, "spherical_high");
    assert_eq!(SphericalHigh::TIER_CODE, "ksph16x8b6_vfp16");
    assert_eq!(SphericalHigh::BYTES_PER_TOKEN, 270.0);
    assert_eq!(SphericalHigh::K_RADIUS_OFFSET, 0);
    assert_eq!(SphericalHigh::K_INDEX_OFFSET, 512);
    assert_eq!(SphericalHigh::V_OFFSET, 896);
    assert!(SphericalHigh::spec_toml().contains("codebook = \"codebooks/sph_g16_b6.safetensors\""));
}
