use kvforge_macros::KvTier;

#[derive(KvTier)]
#[kv(key = "fp16")]
#[kv(value = "int", value_bits = 4, value_group = 24, head_dim = 128)]
struct RaggedGroups;

fn main() {}
