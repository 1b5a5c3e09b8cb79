use kvforge_macros::KvTier;

// A setting given twice.
#[derive(KvTier)]
#[kv(key = "fp16", value = "fp16", key = "bf16")]
struct Twice;

// A scheme that does not take the setting.
#[derive(KvTier)]
#[kv(key = "fp16", value = "fp16", value_bits = 4)]
struct DenseWithBits;

// A spherical codebook that is not there.
#[derive(KvTier)]
#[kv(key = "spherical", key_group = 16, angle_bits = 6, codebook = "codebooks/missing.safetensors", value = "fp16")]
struct NoCodebook;

// A string where an integer belongs, the other way round.
#[derive(KvTier)]
#[kv(key = fp16, value = "fp16")]
struct BareIdent;

fn main() {}
