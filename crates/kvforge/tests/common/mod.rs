//! Fixtures shared by the CLI's integration tests.

/// A small valid spec called `name`: one int8 tier (keys in blocks of 32, values in groups of
/// 32), head dim 64, GQA 1, 32-token pages, 8 warps. Tests derive invalid ones from it by
/// replacing a field.
pub fn small_spec(name: &str) -> String {
    format!(
        r#"[spec]
name = "{name}"

[geometry]
head_dims = [64]
gqa = [1]

[page]
tokens = 32

[[tier]]
name = "q8"
key = {{ scheme = "int", bits = 8, block = 32 }}
value = {{ scheme = "int", bits = 8, group = 32 }}

[kernels]
warps = 8
"#
    )
}
