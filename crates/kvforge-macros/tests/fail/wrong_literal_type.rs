use kvforge_macros::KvTier;

#[derive(KvTier)]
#[kv(key = "int", key_bits = "8", key_block = 16, value = "fp16")]
struct QuotedBits;

fn main() {}
