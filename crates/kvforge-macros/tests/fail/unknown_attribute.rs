use kvforge_macros::KvTier;

#[derive(KvTier)]
#[kv(key = "int", bits = 8, key_block = 16, value = "fp16")]
struct Ambiguous;

fn main() {}
