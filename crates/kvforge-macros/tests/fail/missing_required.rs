use kvforge_macros::KvTier;

// `int` keys need bits and a block: the error points at the scheme and names the attribute.
#[derive(KvTier)]
#[kv(key = "int", key_block = 16, value = "fp16")]
struct NoBits;

// No value scheme at all.
#[derive(KvTier)]
#[kv(key = "fp16")]
struct NoValue;

fn main() {}
