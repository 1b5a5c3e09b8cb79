use kvforge_macros::KvTier;

/// Seed 004's certified tier: int8 K per channel, block 16, fp32 scales; int4 V, group 16,
/// fp16 scales: 288 B per token per head at head dim 128.
#[derive(KvTier)]
#[kv(key = "int", key_bits = 8, key_block = 16, key_scale_dtype = "fp32")]
#[kv(value = "int", value_bits = 4, value_group = 16, value_scale_dtype = "fp16")]
struct Q8K4V;

/// Everything in one list; a default scale dtype (fp16); head dim 64, 32-token pages.
#[derive(KvTier)]
#[kv(key = "int", key_bits = 4, key_block = 32, value = "int", value_bits = 4, value_group = 32, head_dim = 64, page = 32, name = "int4_small")]
struct Int4Small;

/// Generic types work too.
#[derive(KvTier)]
#[kv(key = "int", key_bits = 2, key_block = 64, value = "int", value_bits = 2, value_group = 32)]
#[allow(dead_code)]
struct Int2<T: Copy>(T);

const _: () = assert!(Q8K4V::BYTES_PER_TOKEN == 288.0);
const _: () = assert!(Q8K4V::SEGMENT_BYTES == 288 * 64);

fn main() {
    assert_eq!(Q8K4V::NAME, "q8k4v");
    assert_eq!(Q8K4V::TIER_CODE, "kint8c16f32_vint4g16f16");
    assert_eq!(Q8K4V::HEAD_DIM, 128);
    assert_eq!(Q8K4V::PAGE_TOKENS, 64);
    assert_eq!(Q8K4V::PAYLOAD_BYTES, 288 * 64);
    // K codes 64 x 128 B, scales and zeros 4 blocks x 128 x 4 B each, V codes 64 x 64 B,
    // V scales and zeros 64 x 8 x 2 B each.
    assert_eq!(Q8K4V::K_CODES_OFFSET, 0);
    assert_eq!(Q8K4V::K_SCALE_OFFSET, 8192);
    assert_eq!(Q8K4V::K_ZERO_OFFSET, 8192 + 2048);
    assert_eq!(Q8K4V::V_CODES_OFFSET, 12288);
    assert_eq!(Q8K4V::V_CODES_BYTES, 4096);
    assert_eq!(Q8K4V::V_SCALE_OFFSET, 12288 + 4096);
    assert_eq!(Q8K4V::V_ZERO_OFFSET, 12288 + 4096 + 1024);
    assert_eq!(Q8K4V::PAGE_BYTES, 18432 + 128);
    assert!(Q8K4V::spec_toml().contains("key = { scheme = \"int\", bits = 8, block = 16, scale_dtype = \"fp32\" }"));
    assert!(Q8K4V::TIER_TOML.starts_with("[[tier]]\nname = \"q8k4v\"\n"));

    assert_eq!(Int4Small::NAME, "int4_small");
    assert_eq!(Int4Small::TIER_CODE, "kint4c32f16_vint4g32f16");
    assert_eq!(Int4Small::HEAD_DIM, 64);
    assert_eq!(Int4Small::PAGE_TOKENS, 32);
    // K: 32 B codes + 2 x 64 x 2 B per 32 tokens = 40 B; V: 32 B codes + 2 x 2 x 2 B = 40 B.
    assert_eq!(Int4Small::BYTES_PER_TOKEN, 80.0);

    assert_eq!(Int2::<u8>::TIER_CODE, "kint2c64f16_vint2g32f16");
    assert_eq!(Int2::<u8>::NAME, "int2");
}
