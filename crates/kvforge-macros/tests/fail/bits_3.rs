use kvforge_macros::KvTier;

#[derive(KvTier)]
#[kv(key = "int", key_bits = 3, key_block = 16)]
#[kv(value = "fp16")]
struct ThreeBitKeys;

fn main() {}
