//! Every way a spec can be wrong yields a `SpecError` that points at the right line and
//! column, names the field and says what would be valid. A representative set is also
//! snapshotted as rendered (`file:line:col`, field, message, caret snippet) for review.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvforge_spec::{Codebook, Spec, SpecError, SpecErrorKind, LUT_BUDGET_BYTES};

/// A valid spec; the cases below each break one thing. Line numbers matter: tests name them.
const BASE: &str = r#"[spec]
name = "t"

[geometry]
head_dims = [128]
gqa = [1, 8]
dtype = "fp16"

[page]
tokens = 64

[[tier]]
name = "hi"
key = { scheme = "int", bits = 8, block = 16 }
value = { scheme = "int", bits = 8, group = 32 }

[[tier]]
name = "lo"
key = { scheme = "int", bits = 4, block = 64 }
value = { scheme = "int", bits = 4, group = 32 }

[[tier]]
name = "gone"
key = { scheme = "drop" }
value = { scheme = "drop" }

[kernels]
combinations = [["hi"], ["lo"], ["hi", "lo"]]
"#;

/// Replaces exactly one occurrence of `from`.
fn edit(src: &str, from: &str, to: &str) -> String {
    assert_eq!(src.matches(from).count(), 1, "`{from}` must occur once in the spec");
    src.replacen(from, to, 1)
}

fn parse_in(src: &str, dir: &Path) -> Result<Spec, SpecError> {
    Spec::parse(src, "t.toml", dir)
}

fn fail_in(src: &str, dir: &Path) -> SpecError {
    match parse_in(src, dir) {
        Ok(_) => panic!("spec parsed but should not:\n{src}"),
        Err(e) => e,
    }
}

fn fail(src: &str) -> SpecError {
    fail_in(src, Path::new("."))
}

/// Asserts the error's position, field and that its message contains every `says`.
#[track_caller]
fn check(e: &SpecError, kind: SpecErrorKind, line: usize, column: usize, field: &str, says: &[&str]) {
    assert_eq!((e.line, e.column), (line, column), "position of: {e}");
    assert_eq!(e.field, field, "field of: {e}");
    assert_eq!(e.kind, kind, "kind of: {e}");
    assert_eq!(e.file, "t.toml");
    for s in says {
        assert!(e.message.contains(s), "message should contain {s:?}: {e}");
    }
    // The snippet is the source line the error points at.
    assert!(!e.snippet.is_empty(), "snippet of: {e}");
}

use SpecErrorKind::{Codebook as Cb, Invalid, Syntax};

#[test]
fn base_spec_is_valid() {
    let s = parse_in(BASE, Path::new(".")).unwrap();
    assert_eq!(s.ladder().len(), 3);
}

// ---- unknown keys -------------------------------------------------------------------------

#[test]
fn unknown_top_level_key() {
    let e = fail(&format!("bogus = 1\n{BASE}"));
    check(&e, Syntax, 1, 1, "bogus", &["unknown field `bogus`", "valid: `spec`, `geometry`, `page`, `tier`, `kernels`"]);
    insta::assert_snapshot!("unknown_top_level_key", e.to_string());
}

#[test]
fn unknown_key_in_section() {
    let e = fail(&edit(BASE, "tokens = 64\n", "tokens = 64\ntoken = 64\n"));
    check(&e, Syntax, 11, 1, "page.token", &["unknown field `token`", "valid: `tokens` or `alignment`"]);
}

#[test]
fn unknown_key_in_tier() {
    let e = fail(&edit(BASE, "name = \"lo\"\n", "name = \"lo\"\nbits = 4\n"));
    check(&e, Syntax, 19, 1, "tier[1].bits", &["unknown field `bits`", "valid: `name`, `key`, `value`"]);
    insta::assert_snapshot!("unknown_key_in_tier", e.to_string());
}

#[test]
fn unknown_key_in_scheme_table() {
    let e = fail(&edit(BASE, "bits = 4, block = 64 }", "bits = 4, block = 64, blocks = 2 }"));
    check(&e, Syntax, 19, 47, "tier[1].key.blocks", &["unknown field `blocks`", "`scheme`, `bits`, `block`, `group`"]);
    insta::assert_snapshot!("unknown_key_in_scheme_table", e.to_string());
}

#[test]
fn unknown_key_in_dotted_scheme_table() {
    let src = edit(BASE, "key = { scheme = \"int\", bits = 8, block = 16 }", "key.scheme = \"int\"\nkey.bits = 8\nkey.block = 16\nkey.size = 2");
    let e = fail(&src);
    check(&e, Syntax, 17, 5, "tier[0].key.size", &["unknown field `size`"]);
}

// ---- wrong types --------------------------------------------------------------------------

#[test]
fn wrong_type_string_for_integer() {
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = \"8\", block = 16"));
    check(&e, Syntax, 14, 32, "tier[0].key.bits", &["invalid type: string \"8\", expected an integer"]);
    insta::assert_snapshot!("wrong_type_string_for_integer", e.to_string());
}

/// Scheme fields are typed by the codec that reads them (`ParseCtx::int`, `string`,
/// `float_table`), with the TOML reader's words and the value's location.
#[test]
fn wrong_types_in_scheme_tables() {
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8.0, block = 16"));
    check(&e, Syntax, 14, 32, "tier[0].key.bits", &["invalid type: floating point `8.0`, expected an integer"]);
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8, block = 16, scale_dtype = 32"));
    check(&e, Syntax, 14, 61, "tier[0].key.scale_dtype", &["invalid type: integer `32`, expected a string"]);
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8, block = [16]"));
    check(&e, Syntax, 14, 43, "tier[0].key.block", &["invalid type: array, expected an integer"]);
    let e = fail(&mixed("{ 8 = \"x\" }"));
    check(&e, Syntax, 19, 44, "tier[1].key.channels.8", &["invalid type: string \"x\", expected f64"]);
    let e = fail(&mixed("0.5"));
    check(&e, Syntax, 19, 38, "tier[1].key.channels", &["invalid type: floating point `0.5`, expected a map"]);
    // An integer share reads as a number, as it did when the field was a typed f64.
    parse_in(&mixed("{ 8 = 1 }"), Path::new(".")).unwrap();
}

#[test]
fn wrong_type_scalar_for_list() {
    let e = fail(&edit(BASE, "head_dims = [128]", "head_dims = 128"));
    check(&e, Syntax, 5, 13, "geometry.head_dims", &["expected an array"]);
}

#[test]
fn wrong_type_in_list() {
    let e = fail(&edit(BASE, "gqa = [1, 8]", "gqa = [1, \"8\"]"));
    check(&e, Syntax, 6, 11, "geometry.gqa[1]", &["expected an integer"]);
}

#[test]
fn wrong_type_bool() {
    let e = fail(&format!("{BASE}split_k = \"yes\"\n"));
    check(&e, Syntax, 29, 11, "kernels.split_k", &["expected a boolean"]);
}

#[test]
fn wrong_type_table_for_tier_array() {
    let src = edit(BASE.split("\n[[tier]]\nname = \"lo\"").next().unwrap(), "[[tier]]", "[tier]");
    let e = fail(&src);
    check(&e, Syntax, 12, 1, "tier", &["invalid type: table, expected an array"]);
}

// ---- int scheme ---------------------------------------------------------------------------

#[test]
fn bits_not_supported() {
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 3, block = 16"));
    check(&e, Invalid, 14, 32, "tier[0].key.bits", &["bits 3 is not supported", "valid: 8, 4, 2"]);
    insta::assert_snapshot!("bits_not_supported", e.to_string());
}

#[test]
fn bits_16_points_to_fp16() {
    let e = fail(&edit(BASE, "bits = 8, group = 32", "bits = 16, group = 32"));
    check(&e, Invalid, 15, 34, "tier[0].value.bits", &["bits 16", "use `fp16` for 16"]);
}

#[test]
fn int_value_group_does_not_divide_head_dim() {
    let e = fail(&edit(BASE, "bits = 8, group = 32", "bits = 8, group = 24"));
    check(&e, Invalid, 15, 45, "tier[0].value.group", &["group_size 24 does not divide head_dim 128", "valid: 8, 16, 32, 64, 128"]);
    insta::assert_snapshot!("int_value_group_does_not_divide_head_dim", e.to_string());
}

#[test]
fn int_value_group_not_multiple_of_8() {
    let e = fail(&edit(BASE, "bits = 8, group = 32", "bits = 8, group = 4"));
    check(&e, Invalid, 15, 45, "tier[0].value.group", &["group_size 4 is not a multiple of 8", "valid: 8, 16"]);
    let e = fail(&edit(BASE, "bits = 8, group = 32", "bits = 8, group = 0"));
    check(&e, Invalid, 15, 45, "tier[0].value.group", &["group_size 0 is not a multiple of 8"]);
}

#[test]
fn int_value_group_checked_at_every_head_dim() {
    let src = edit(BASE, "head_dims = [128]", "head_dims = [128, 64]");
    let e = fail(&edit(&src, "bits = 8, group = 32", "bits = 8, group = 128"));
    check(&e, Invalid, 15, 45, "tier[0].value.group", &["group_size 128 does not divide head_dim 64", "valid: 8, 16, 32, 64"]);
}

#[test]
fn block_does_not_divide_page_tokens() {
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8, block = 48"));
    check(&e, Invalid, 14, 43, "tier[0].key.block", &["block 48 does not divide page tokens 64", "valid: 1, 2, 4, 8, 16, 32, 64"]);
    insta::assert_snapshot!("block_does_not_divide_page_tokens", e.to_string());
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8, block = -16"));
    check(&e, Invalid, 14, 43, "tier[0].key.block", &["block -16 does not divide page tokens 64"]);
}

#[test]
fn block_checked_against_page_tokens_given() {
    let e = fail(&edit(BASE, "tokens = 64", "tokens = 32"));
    check(&e, Invalid, 19, 43, "tier[1].key.block", &["block 64 does not divide page tokens 32"]);
}

#[test]
fn key_granularity_must_be_channel() {
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8, block = 16, granularity = \"token\""));
    check(&e, Invalid, 14, 61, "tier[0].key.granularity", &["key granularity `token`", "valid: channel"]);
}

#[test]
fn value_granularity_must_be_token() {
    let e = fail(&edit(BASE, "bits = 8, group = 32", "bits = 8, group = 32, granularity = \"channel\""));
    check(&e, Invalid, 15, 63, "tier[0].value.granularity", &["value granularity `channel`", "valid: token"]);
}

#[test]
fn scale_dtype_invalid() {
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8, block = 16, scale_dtype = \"fp8\""));
    check(&e, Invalid, 14, 61, "tier[0].key.scale_dtype", &["scale_dtype `fp8`", "valid: fp16, fp32"]);
}

#[test]
fn unknown_scheme() {
    let e = fail(&edit(BASE, "{ scheme = \"int\", bits = 4, block = 64 }", "{ scheme = \"int4\", bits = 4, block = 64 }"));
    check(&e, Invalid, 19, 18, "tier[1].key.scheme", &["unknown key scheme `int4`", "valid: fp16, bf16, int, spherical, mixed, rotated, drop"]);
    let e = fail(&edit(BASE, "{ scheme = \"int\", bits = 4, group = 32 }", "{ scheme = \"fp8\" }"));
    check(&e, Invalid, 20, 20, "tier[1].value.scheme", &["unknown value scheme `fp8`", "valid: fp16, bf16, int, rotated, drop"]);
}

#[test]
fn spherical_values_rejected() {
    let e = fail(&edit(BASE, "{ scheme = \"int\", bits = 4, group = 32 }", "{ scheme = \"spherical\", group = 16 }"));
    check(&e, Invalid, 20, 20, "tier[1].value.scheme", &["spherical coding is for keys", "valid value schemes: fp16, bf16, int, rotated, drop"]);
}

// ---- fields a scheme does not take, missing fields ----------------------------------------

#[test]
fn field_the_scheme_does_not_take() {
    let src = edit(BASE, "value = { scheme = \"int\", bits = 8, group = 32 }", "value = { scheme = \"fp16\", group = 32 }");
    let e = fail(&src);
    check(&e, Invalid, 15, 36, "tier[0].value.group", &["scheme `fp16` takes no `group`", "its fields: none"]);
    insta::assert_snapshot!("field_the_scheme_does_not_take", e.to_string());
}

#[test]
fn int_key_takes_no_group_and_drop_takes_nothing() {
    let e = fail(&edit(BASE, "bits = 4, block = 64 }", "bits = 4, block = 64, group = 32 }"));
    check(&e, Invalid, 19, 55, "tier[1].key.group", &["scheme `int` takes no `group`", "its fields: bits, block, scale_dtype, granularity"]);
    let e = fail(&edit(BASE, "key = { scheme = \"drop\" }", "key = { scheme = \"drop\", bits = 0 }"));
    check(&e, Invalid, 24, 33, "tier[2].key.bits", &["scheme `drop` takes no `bits`"]);
    let e = fail(&edit(BASE, "bits = 8, group = 32 }", "bits = 8, group = 32, block = 16 }"));
    check(&e, Invalid, 15, 57, "tier[0].value.block", &["scheme `int` takes no `block`", "its fields: bits, group, scale_dtype, granularity"]);
}

#[test]
fn missing_required_scheme_field() {
    let e = fail(&edit(BASE, "{ scheme = \"int\", bits = 8, block = 16 }", "{ scheme = \"int\", bits = 8 }"));
    check(&e, Invalid, 14, 7, "tier[0].key.block", &["scheme `int` needs `block`", "dividing the page"]);
    insta::assert_snapshot!("missing_required_scheme_field", e.to_string());
    let e = fail(&edit(BASE, "{ scheme = \"int\", bits = 4, group = 32 }", "{ scheme = \"int\", group = 32 }"));
    check(&e, Invalid, 20, 9, "tier[1].value.bits", &["scheme `int` needs `bits`", "8, 4 or 2"]);
    let e = fail(&edit(BASE, "{ scheme = \"int\", bits = 4, group = 32 }", "{ scheme = \"int\", bits = 4 }"));
    check(&e, Invalid, 20, 9, "tier[1].value.group", &["scheme `int` needs `group`"]);
}

#[test]
fn missing_scheme() {
    let e = fail(&edit(BASE, "{ scheme = \"int\", bits = 8, block = 16 }", "{ bits = 8, block = 16 }"));
    check(&e, Syntax, 14, 7, "tier[0].key.scheme", &["missing required field `scheme`", "fp16, bf16, int, spherical, drop"]);
}

#[test]
fn missing_tier_fields() {
    let e = fail(&edit(BASE, "name = \"lo\"\n", ""));
    check(&e, Syntax, 17, 1, "tier[1].name", &["missing required field `name`"]);
    insta::assert_snapshot!("missing_tier_name", e.to_string());
    let e = fail(&edit(BASE, "value = { scheme = \"drop\" }\n", ""));
    check(&e, Syntax, 22, 1, "tier[2].value", &["missing required field `value`", "scheme table"]);
}

#[test]
fn missing_sections() {
    let e = fail(&edit(BASE, "[spec]\nname = \"t\"\n", "[spec]\n"));
    check(&e, Syntax, 1, 1, "spec.name", &["missing required field `name`"]);
    let e = fail(&edit(BASE, "gqa = [1, 8]\n", ""));
    check(&e, Syntax, 4, 1, "geometry.gqa", &["missing required field `gqa`", "valid: 1, 2, 3, 4, 6, 8"]);
    let e = fail(&edit(BASE, "[geometry]\nhead_dims = [128]\ngqa = [1, 8]\ndtype = \"fp16\"\n", ""));
    check(&e, Syntax, 1, 1, "geometry", &["missing required field `geometry`", "head_dims"]);
    let no_tiers = BASE.split("[[tier]]").next().unwrap().to_string();
    let e = fail(&no_tiers);
    check(&e, Syntax, 1, 1, "tier", &["missing required field `tier`", "at least one [[tier]]"]);
}

#[test]
fn empty_file() {
    let e = Spec::parse("", "t.toml", Path::new(".")).unwrap_err();
    assert_eq!((e.line, e.column, e.field.as_str()), (1, 1, "spec"));
    assert!(e.message.contains("missing required field `spec`"), "{e}");
}

// ---- geometry, page, kernels --------------------------------------------------------------

#[test]
fn dtype_invalid() {
    let e = fail(&edit(BASE, "dtype = \"fp16\"", "dtype = \"fp8\""));
    check(&e, Invalid, 7, 9, "geometry.dtype", &["dtype `fp8` is not supported", "valid: fp16, bf16"]);
    insta::assert_snapshot!("dtype_invalid", e.to_string());
}

#[test]
fn head_dims_invalid() {
    let e = fail(&edit(BASE, "head_dims = [128]", "head_dims = [128, 96]"));
    check(&e, Invalid, 5, 19, "geometry.head_dims", &["head_dim 96 is not supported", "valid: 64, 128, 256"]);
    insta::assert_snapshot!("head_dims_invalid", e.to_string());
    let e = fail(&edit(BASE, "head_dims = [128]", "head_dims = []"));
    check(&e, Invalid, 5, 13, "geometry.head_dims", &["list at least one head_dim; valid: 64, 128, 256"]);
    let e = fail(&edit(BASE, "head_dims = [128]", "head_dims = [128, 128]"));
    check(&e, Invalid, 5, 19, "geometry.head_dims", &["head_dim 128 is listed twice"]);
}

#[test]
fn gqa_invalid() {
    let e = fail(&edit(BASE, "gqa = [1, 8]", "gqa = [1, 16]"));
    check(&e, Invalid, 6, 11, "geometry.gqa", &["gqa 16 is not supported", "valid: 1, 2, 3, 4, 6, 8"]);
}

#[test]
fn page_tokens_invalid() {
    let e = fail(&edit(BASE, "tokens = 64", "tokens = 48"));
    check(&e, Invalid, 10, 10, "page.tokens", &["page tokens 48 is not supported", "valid: 16, 32, 64, 128"]);
    insta::assert_snapshot!("page_tokens_invalid", e.to_string());
}

#[test]
fn page_alignment_invalid() {
    let e = fail(&edit(BASE, "tokens = 64", "tokens = 64\nalignment = 100"));
    check(&e, Invalid, 11, 13, "page.alignment", &["alignment 100 must be a power of two from 16 to 4096"]);
}

#[test]
fn page_segment_over_stage_budget() {
    let src = edit(BASE, "tokens = 64", "tokens = 128");
    let src = edit(&src, "head_dims = [128]", "head_dims = [256]");
    let src = edit(&src, "block = 64", "block = 128");
    let src = edit(&src, "value = { scheme = \"int\", bits = 8, group = 32 }", "value = { scheme = \"fp16\" }");
    let src = edit(&src, "key = { scheme = \"int\", bits = 8, block = 16 }", "key = { scheme = \"fp16\" }");
    let e = fail(&src);
    check(&e, Invalid, 13, 8, "tier[0]", &["needs a 131072 B page segment at head_dim 256 with 128 tokens", "at most 98304 B"]);
}

#[test]
fn ctas_per_sm_out_of_range() {
    // 4 warps (the default) are 128 threads: an SM runs at most 16 such CTAs.
    let e = fail(&format!("{BASE}ctas_per_sm = 17\n"));
    check(&e, Invalid, 29, 15, "kernels.ctas_per_sm", &["17 CTAs of 128 threads", "valid 1 to 16"]);
    let e = fail(&format!("{BASE}warps = 8\nctas_per_sm = 0\n"));
    check(&e, Invalid, 30, 15, "kernels.ctas_per_sm", &["0 CTAs of 256 threads", "valid 1 to 8"]);
    let s = parse_in(&format!("{BASE}ctas_per_sm = 3\n"), Path::new(".")).unwrap();
    assert_eq!(s.kernels.ctas_per_sm, 3);
    assert_eq!(parse_in(BASE, Path::new(".")).unwrap().kernels.ctas_per_sm, 4, "default: 512 threads per SM");
}

#[test]
fn dense_shape_is_checked_like_the_kernels_shape() {
    let e = fail(&format!("{BASE}dense = {{ warps = 6 }}\n"));
    check(&e, Invalid, 29, 19, "kernels.dense.warps", &["warps 6 is not supported", "valid: 4, 8"]);
    let e = fail(&format!("{BASE}dense = {{ warps = 8, ctas_per_sm = 9 }}\n"));
    check(&e, Invalid, 29, 36, "kernels.dense.ctas_per_sm", &["9 CTAs of 256 threads", "valid 1 to 8"]);
    let e = fail(&format!("{BASE}dense = {{ warp = 8 }}\n"));
    assert!(e.to_string().contains("warp"), "unknown key named: {e}");
    let s = parse_in(&format!("{BASE}dense = {{ warps = 8, ctas_per_sm = 2 }}\n"), Path::new(".")).unwrap();
    assert_eq!(s.kernels.dense, Some(kvforge_spec::KernelShape { warps: 8, ctas_per_sm: 2 }));
    assert_eq!(parse_in(BASE, Path::new(".")).unwrap().kernels.dense, None, "default: the kernels' own shape");
}

#[test]
fn stage_kib_out_of_range() {
    let e = fail(&format!("{BASE}stage_kib = 4\n"));
    check(&e, Invalid, 29, 13, "kernels.stage_kib", &["4 KiB of page stages per CTA", "valid 8 to 200"]);
    let e = fail(&format!("{BASE}stage_kib = 512\n"));
    check(&e, Invalid, 29, 13, "kernels.stage_kib", &["512 KiB", "valid 8 to 200"]);
    assert_eq!(parse_in(&format!("{BASE}stage_kib = 48\n"), Path::new(".")).unwrap().kernels.stage_kib, Some(48));
    assert_eq!(parse_in(BASE, Path::new(".")).unwrap().kernels.stage_kib, None, "default: the generator's rule");
}

#[test]
fn certified_entry_is_opt_in() {
    let s = parse_in(BASE, Path::new(".")).unwrap();
    assert!(!s.kernels.certified, "default: no certified entry");
    assert!(s.certify_variants().is_empty(), "no certify kernels without it");
    let s = parse_in(&format!("{BASE}certified = true\n"), Path::new(".")).unwrap();
    assert!(s.kernels.certified);
    assert_eq!(s.certify_variants().len(), 2 * s.geometry.gqa.len(), "a selector and a certificate per gqa");
    let e = fail(&format!("{BASE}certified = 1\n"));
    assert!(e.to_string().contains("boolean"), "a typed error for a non-bool: {e}");
}

#[test]
fn warps_invalid() {
    let e = fail(&format!("{BASE}warps = 6\n"));
    check(&e, Invalid, 29, 9, "kernels.warps", &["warps 6 is not supported", "valid: 4, 8"]);
}

#[test]
fn unknown_tier_in_combinations() {
    let e = fail(&edit(BASE, "[\"hi\", \"lo\"]]", "[\"hi\", \"low\"]]"));
    check(&e, Invalid, 28, 40, "kernels.combinations[2]", &["unknown tier `low`", "valid: hi, lo"]);
    insta::assert_snapshot!("unknown_tier_in_combinations", e.to_string());
}

#[test]
fn bad_combinations() {
    let e = fail(&edit(BASE, "[\"hi\", \"lo\"]]", "[\"hi\", \"gone\"]]"));
    check(&e, Invalid, 28, 40, "kernels.combinations[2]", &["`gone` is the drop tier"]);
    let e = fail(&edit(BASE, "[\"hi\", \"lo\"]]", "[\"hi\", \"hi\"]]"));
    check(&e, Invalid, 28, 40, "kernels.combinations[2]", &["tier `hi` is listed twice"]);
    let e = fail(&edit(BASE, "[\"hi\", \"lo\"]]", "[\"lo\", \"hi\"], [\"hi\", \"lo\"]]"));
    check(&e, Invalid, 28, 47, "kernels.combinations[3]", &["this combination is listed twice"]);
    let e = fail(&edit(BASE, "[[\"hi\"], [\"lo\"], [\"hi\", \"lo\"]]", "[]"));
    check(&e, Invalid, 28, 16, "kernels.combinations", &["list at least one tier combination"]);
}

// ---- tier ladder --------------------------------------------------------------------------

#[test]
fn duplicate_tier_names() {
    let e = fail(&edit(BASE, "name = \"lo\"", "name = \"hi\""));
    check(&e, Invalid, 18, 8, "tier[1].name", &["tier name `hi` is already used by tier[0]", "must be unique"]);
    insta::assert_snapshot!("duplicate_tier_names", e.to_string());
}

#[test]
fn tier_named_tail_is_reserved() {
    let e = fail(&edit(BASE, "name = \"lo\"", "name = \"tail\""));
    check(&e, Invalid, 18, 8, "tier[1].name", &["`tail` is reserved for the implicit tail tier"]);
}

#[test]
fn tier_and_spec_names_checked() {
    let e = fail(&edit(BASE, "name = \"lo\"", "name = \"lo-4\""));
    check(&e, Invalid, 18, 8, "tier[1].name", &["tier name `lo-4` must be letters, digits and `_`"]);
    let e = fail(&edit(BASE, "name = \"t\"", "name = \"T\""));
    check(&e, Invalid, 2, 8, "spec.name", &["spec name `T` must be lowercase"]);
}

#[test]
fn tier_ladder_not_ordered_by_bytes() {
    // `hi` (int4 keys, int8 values: 240 B) before `lo` (int8 keys, int8 values: 280 B).
    let src = edit(BASE, "bits = 4, block = 64", "bits = 8, block = 64");
    let src = edit(&src, "bits = 4, group = 32", "bits = 8, group = 32");
    let src = edit(&src, "key = { scheme = \"int\", bits = 8, block = 16 }", "key = { scheme = \"int\", bits = 4, block = 16 }");
    let e = fail(&src);
    check(&e, Invalid, 18, 8, "tier[1]", &["ordered from most to least bytes", "`lo` costs", "more than `hi`", "head_dim 128"]);
    insta::assert_snapshot!("tier_ladder_not_ordered_by_bytes", e.to_string());
}

#[test]
fn tiers_that_code_alike() {
    let src = edit(
        BASE,
        "name = \"hi\"\nkey = { scheme = \"int\", bits = 8, block = 16 }\nvalue = { scheme = \"int\", bits = 8, group = 32 }",
        "name = \"hi\"\nkey = { scheme = \"int\", bits = 4, block = 64 }\nvalue = { scheme = \"int\", bits = 4, group = 32 }",
    );
    let e = fail(&src);
    check(&e, Invalid, 18, 8, "tier[1]", &["codes exactly like tier `hi`", "merge them"]);
}

#[test]
fn drop_not_last() {
    let src = format!("{}\n[[tier]]\nname = \"after\"\nkey = {{ scheme = \"int\", bits = 2, block = 64 }}\nvalue = {{ scheme = \"int\", bits = 2, group = 32 }}\n", BASE.split("\n[kernels]").next().unwrap());
    let e = fail(&src);
    check(&e, Invalid, 28, 8, "tier[3]", &["`after` follows the drop tier `gone`", "drop must be last"]);
    insta::assert_snapshot!("drop_not_last", e.to_string());
}

#[test]
fn drop_only_on_key_or_value() {
    let e = fail(&edit(BASE, "value = { scheme = \"drop\" }", "value = { scheme = \"fp16\" }"));
    check(&e, Invalid, 24, 18, "tier[2].key.scheme", &["`drop` must be the scheme of both key and value", "the value is fp16"]);
    insta::assert_snapshot!("drop_only_on_key", e.to_string());
    let e = fail(&edit(BASE, "key = { scheme = \"drop\" }", "key = { scheme = \"int\", bits = 2, block = 64 }"));
    check(&e, Invalid, 25, 20, "tier[2].value.scheme", &["`drop` must be the scheme of both key and value", "the key is int2"]);
}

#[test]
fn only_a_drop_tier() {
    let src = format!("{}[[tier]]\nname = \"gone\"\nkey = {{ scheme = \"drop\" }}\nvalue = {{ scheme = \"drop\" }}\n", BASE.split("[[tier]]").next().unwrap());
    let e = fail(&src);
    check(&e, Invalid, 12, 1, "tier", &["only the drop tier", "at least one tier that keeps"]);
}

#[test]
fn too_many_tiers() {
    let mut src = BASE.split("[[tier]]").next().unwrap().to_string();
    for i in 0..16 {
        src += &format!("[[tier]]\nname = \"t{i}\"\nkey = {{ scheme = \"fp16\" }}\nvalue = {{ scheme = \"fp16\" }}\n");
    }
    let e = fail(&src);
    check(&e, Invalid, 12, 1, "tier", &["at most 15 tiers"]);
}

// ---- spherical keys and codebooks ---------------------------------------------------------

/// A fresh directory for one test's codebooks.
fn tmp(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvforge-spec-errors").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `entries` unit vectors in R^group (or scaled by `norm`).
fn codebook(entries: usize, group: usize, norm: f32) -> Codebook {
    let mut data = Vec::new();
    for i in 0..entries {
        let row: Vec<f32> = (0..group).map(|j| ((i * 7 + j * 3) as f32 * 0.37).sin() + 0.1).collect();
        let n = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        data.extend(row.iter().map(|x| x / n * norm));
    }
    Codebook::new("cb.safetensors".into(), entries, group, data, HashMap::new())
}

fn spherical(group: usize, angle_bits: u32, codebook: &str) -> String {
    edit(BASE, "key = { scheme = \"int\", bits = 8, block = 16 }", &format!("key = {{ scheme = \"spherical\", group = {group}, angle_bits = {angle_bits}, codebook = \"{codebook}\" }}"))
}

#[test]
fn spherical_valid_with_codebook() {
    let d = tmp("valid");
    codebook(16, 16, 1.0).save(&d.join("cb.safetensors")).unwrap();
    // The spherical tier (8 x (1 + 0.5) + 256 B) must still cost more than `lo` (int4): it does.
    let s = parse_in(&spherical(16, 4, "cb.safetensors"), &d).unwrap();
    assert_eq!(s.tier("hi").unwrap().code(128).0, "ksph16x8b4_vint8g32f16");
}

#[test]
fn spherical_group_does_not_divide_head_dim() {
    let e = fail(&spherical(24, 4, "cb.safetensors"));
    check(&e, Invalid, 14, 39, "tier[0].key.group", &["group_size 24 does not divide head_dim 128", "valid: 1, 2, 4, 8, 16, 32, 64, 128"]);
    insta::assert_snapshot!("spherical_group_does_not_divide_head_dim", e.to_string());
}

#[test]
fn spherical_angle_bits_out_of_range() {
    let e = fail(&spherical(16, 9, "cb.safetensors"));
    check(&e, Invalid, 14, 56, "tier[0].key.angle_bits", &["angle_bits 9 is not supported", "valid: 1 to 8"]);
}

#[test]
fn spherical_radius_bits_must_be_8() {
    let src = edit(&spherical(16, 4, "cb.safetensors"), "angle_bits = 4,", "angle_bits = 4, radius_bits = 4,");
    let e = fail(&src);
    check(&e, Invalid, 14, 73, "tier[0].key.radius_bits", &["radius_bits 4 is not supported", "valid: 8"]);
}

#[test]
fn codebook_larger_than_lut_budget() {
    // 8 angle bits, group 16, gqa 8: 8 x 16 groups x 256 x 4 B = 128 KiB at head_dim 256.
    let src = edit(&spherical(16, 8, "cb.safetensors"), "head_dims = [128]", "head_dims = [128, 256]");
    let e = fail(&src);
    check(
        &e,
        Invalid,
        14,
        56,
        "tier[0].key.angle_bits",
        &["2^8 entries needs a 131072 B lookup table at head_dim 256, gqa 8", &format!("{LUT_BUDGET_BYTES} B shared-memory budget"), "use angle_bits 7 or less"],
    );
    insta::assert_snapshot!("codebook_larger_than_lut_budget", e.to_string());
}

#[test]
fn combination_larger_than_lut_budget() {
    // Each tier fits alone at head_dim 128, gqa 8 (8 x 8 x 256 x 4 = 64 KiB, 8 x 8 x 16 x 4);
    // together they do not.
    let d = tmp("lut_combo");
    codebook(256, 16, 1.0).save(&d.join("cb8.safetensors")).unwrap();
    codebook(16, 16, 1.0).save(&d.join("cb4.safetensors")).unwrap();
    let src = edit(&spherical(16, 8, "cb8.safetensors"), "key = { scheme = \"int\", bits = 4, block = 64 }", "key = { scheme = \"spherical\", group = 16, angle_bits = 4, codebook = \"cb4.safetensors\" }");
    let e = fail_in(&src, &d);
    check(&e, Invalid, 28, 33, "kernels.combinations[2]", &["tiers `hi`, `lo` in one launch need 69632 B", "split the combination"]);
    // Without explicit combinations the default all-tier combination is the one that fails.
    let e = fail_in(src.split("\n[kernels]").next().unwrap(), &d);
    check(&e, Invalid, 12, 1, "kernels.combinations", &["the default combinations serve all tiers (`hi`, `lo`)", "list smaller [kernels] combinations"]);
    // Split, it is fine.
    parse_in(&edit(&src, ", [\"hi\", \"lo\"]]", "]"), &d).unwrap();
}

#[test]
fn codebook_file_missing() {
    let d = tmp("missing");
    let e = fail_in(&spherical(16, 4, "nowhere.safetensors"), &d);
    check(&e, Cb, 14, 70, "tier[0].key.codebook", &["cannot read codebook file nowhere.safetensors"]);
}

#[test]
fn codebook_not_safetensors() {
    let d = tmp("garbage");
    std::fs::write(d.join("cb.safetensors"), b"not a safetensors file").unwrap();
    let e = fail_in(&spherical(16, 4, "cb.safetensors"), &d);
    check(&e, Cb, 14, 70, "tier[0].key.codebook", &["cb.safetensors is not a safetensors file"]);
}

#[test]
fn codebook_wrong_shape() {
    let d = tmp("shape");
    codebook(16, 32, 1.0).save(&d.join("cb.safetensors")).unwrap();
    let e = fail_in(&spherical(16, 4, "cb.safetensors"), &d);
    check(&e, Cb, 14, 70, "tier[0].key.codebook", &["has shape [16, 32], expected [16, 16]", "2^angle_bits entries of group channels"]);
    insta::assert_snapshot!("codebook_wrong_shape", e.to_string());
    // Entries follow angle_bits.
    codebook(8, 16, 1.0).save(&d.join("cb.safetensors")).unwrap();
    let e = fail_in(&spherical(16, 4, "cb.safetensors"), &d);
    check(&e, Cb, 14, 70, "tier[0].key.codebook", &["has shape [8, 16], expected [16, 16]"]);
}

#[test]
fn codebook_not_unit_norm() {
    let d = tmp("norm");
    let mut cb = codebook(16, 16, 1.0);
    for x in &mut cb.data[5 * 16..6 * 16] {
        *x *= 1.5;
    }
    cb.save(&d.join("cb.safetensors")).unwrap();
    let e = fail_in(&spherical(16, 4, "cb.safetensors"), &d);
    check(&e, Cb, 14, 70, "tier[0].key.codebook", &["codeword 5 has norm 1.50000", "must be unit vectors"]);
    insta::assert_snapshot!("codebook_not_unit_norm", e.to_string());
    // NaN is not unit norm either.
    let mut cb = codebook(16, 16, 1.0);
    cb.data[3] = f32::NAN;
    cb.save(&d.join("cb.safetensors")).unwrap();
    let e = fail_in(&spherical(16, 4, "cb.safetensors"), &d);
    check(&e, Cb, 14, 70, "tier[0].key.codebook", &["codeword 0 has norm NaN"]);
}

// ---- TOML syntax --------------------------------------------------------------------------

#[test]
fn toml_syntax_error() {
    let e = fail(&edit(BASE, "[page]", "[page"));
    assert_eq!((e.kind.clone(), e.line, e.column), (Syntax, 9, 6), "{e}");
    let e = fail(&edit(BASE, "tokens = 64\n", "tokens = 64\ntokens = 32\n"));
    check(&e, Syntax, 11, 1, "page.tokens", &["duplicate key `tokens`", "once per table"]);
    let e = fail(&edit(BASE, "bits = 8, block = 16", "bits = 8, block = 16, bits = 4"));
    check(&e, Syntax, 14, 47, "tier[0].key.bits", &["duplicate key `bits`"]);
    let e = fail(&edit(BASE, "name = \"lo\"\n", "name = \"lo\"\nname = \"lo2\"\n"));
    check(&e, Syntax, 19, 1, "tier[1].name", &["duplicate key `name`"]);
    let e = fail(&edit(BASE, "key = { scheme = \"drop\" }", "key.scheme = \"drop\"\nkey.scheme = \"drop\""));
    check(&e, Syntax, 25, 5, "tier[2].key.scheme", &["duplicate key `scheme`"]);
    let e = fail(&format!("{BASE}[page]\n"));
    check(&e, Syntax, 29, 2, "page", &["duplicate key `page`"]);
}

#[test]
fn errors_render_with_caret() {
    let e = fail(&edit(BASE, "tokens = 64", "tokens = 48"));
    let shown = e.to_string();
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines[0], "t.toml:10:10: `page.tokens`: page tokens 48 is not supported; valid: 16, 32, 64, 128");
    assert_eq!(lines[1], "    | tokens = 48");
    assert_eq!(lines[2], "    |          ^");
}

#[test]
fn unreadable_spec_file() {
    let e = Spec::load(Path::new("/nonexistent/kvforge/spec.toml")).unwrap_err();
    assert_eq!((e.kind.clone(), e.line, e.column), (SpecErrorKind::Io, 0, 0));
    assert!(e.to_string().starts_with("/nonexistent/kvforge/spec.toml: cannot read spec"), "{e}");
}

/// The `lo` tier's key as a mixed per-channel key with `channels` (line 19).
fn mixed(channels: &str) -> String {
    edit(BASE, r#"key = { scheme = "int", bits = 4, block = 64 }"#, &format!(r#"key = {{ scheme = "mixed", channels = {channels}, block = 64 }}"#))
}

#[test]
fn mixed_key_parses_sorted_by_width() {
    let s = parse_in(&mixed("{ 4 = 0.5, 16 = 0.125, 2 = 0.25 }"), Path::new(".")).unwrap();
    let kvforge_spec::KeyScheme::Mixed { segments, block, .. } = &s.tiers[2].key else { panic!("{:?}", s.tiers[2].key) };
    assert_eq!(*block, 64);
    let got: Vec<(u32, u32)> = segments.iter().map(|s| (s.bits, s.eighths)).collect();
    assert_eq!(got, [(16, 1), (4, 4), (2, 2)]);
    // 16 fp16 + 64 int4 + 32 int2 channels of 128 (16 dropped): 32 + 32 + 8 code bytes per
    // token, fp16 scale and zero per channel per 64-token block.
    assert_eq!(s.tiers[2].key.page_bytes(128, 64), 64 * 72 + 2 * 2 * (64 + 32));
    assert_eq!(s.tiers[2].code(128).0, "kmix16x1_4x4_2x2c64f16_vint4g32f16");
}

#[test]
fn mixed_key_errors() {
    let e = fail(&mixed("{ 3 = 0.5 }"));
    check(&e, Invalid, 19, 44, "tier[1].key.channels", &["bit width `3` is not supported", "valid: 16, 8, 4, 2"]);
    let e = fail(&mixed("{ 8 = 0.3 }"));
    check(&e, Invalid, 19, 44, "tier[1].key.channels", &["share 0.3", "multiple of 1/8"]);
    let e = fail(&mixed("{ 8 = 0.75, 4 = 0.5 }"));
    check(&e, Invalid, 19, 38, "tier[1].key.channels", &["add up to 10/8", "between 1/8 and 1"]);
    let e = fail(&mixed("{}"));
    check(&e, Invalid, 19, 38, "tier[1].key.channels", &["add up to 0/8"]);
    let e = fail(&edit(BASE, r#"key = { scheme = "int", bits = 4, block = 64 }"#, r#"key = { scheme = "mixed", block = 64 }"#));
    check(&e, Invalid, 19, 7, "tier[1].key.channels", &["needs `channels`"]);
    let e = fail(&edit(BASE, r#"key = { scheme = "int", bits = 4, block = 64 }"#, r#"key = { scheme = "mixed", channels = { 8 = 1.0 }, bits = 4 }"#));
    check(&e, Invalid, 19, 58, "tier[1].key.bits", &["takes no `bits`", "channels, block, scale_dtype"]);
    insta::assert_snapshot!("mixed_key_share_not_eighths", fail(&mixed("{ 8 = 0.3 }")).to_string());
}

/// Issue 24: what the kernels `static_assert` is checked by the validator
/// (`kvforge_spec::constraints`), so that a spec that validates compiles.
const SMALL: &str = r#"[spec]
name = "t"

[geometry]
head_dims = [64]
gqa = [1]

[page]
tokens = 16

[[tier]]
name = "q8"
key = { scheme = "int", bits = 8, block = 16 }
value = { scheme = "int", bits = 8, group = 32 }

[kernels]
warps = 8
"#;

#[test]
fn page_too_small_for_the_value_tiles_of_8_warps() {
    let e = fail(SMALL);
    check(&e, Invalid, 9, 10, "page.tokens", &["head_dim 64", "8 warps", "tensor-core value tiles", "valid page.tokens at head_dim 64: 32, 64", "`kernels.warps` = 4"]);
    parse_in(&edit(SMALL, "warps = 8", "warps = 4"), Path::new(".")).unwrap();
    parse_in(&edit(&edit(SMALL, "head_dims = [64]", "head_dims = [128]"), "warps = 8", "warps = 8"), Path::new(".")).unwrap();
}

#[test]
fn dense_launch_warps_are_checked_too() {
    // rdkv's shape: 4 warps, dense launches 8: the fp16 launch is the one that cannot compile.
    let src = edit(
        &edit(SMALL, "warps = 8", "warps = 4\ndense = { warps = 8 }"),
        "[[tier]]\nname = \"q8\"",
        "[[tier]]\nname = \"hi\"\nkey = { scheme = \"fp16\" }\nvalue = { scheme = \"fp16\" }\n\n[[tier]]\nname = \"q8\"",
    );
    let e = fail(&src);
    assert_eq!(e.field, "page.tokens", "{e}");
    assert!(e.message.contains("kernels.dense.warps") && e.message.contains("tiers hi"), "{e}");
}

#[test]
fn page_longer_than_head_dim() {
    let src = edit(&edit(SMALL, "tokens = 16", "tokens = 128"), "block = 16", "block = 128");
    let e = fail(&src);
    check(&e, Invalid, 9, 10, "page.tokens", &["128 tokens", "head_dim 64", "valid page.tokens at head_dim 64: 32, 64"]);
}

#[test]
fn key_blocks_are_whole_tensor_core_tiles() {
    let src = edit(&edit(SMALL, "tokens = 16", "tokens = 32"), "block = 16", "block = 8");
    let e = fail(&src);
    check(&e, Invalid, 13, 43, "tier[0].key.block", &["key block 8", "multiple of 16", "valid at page.tokens 32: 16, 32"]);
}

#[test]
fn a_scheme_written_as_a_string_says_it_must_be_a_table() {
    let e = fail(&edit(SMALL, r#"key = { scheme = "int", bits = 8, block = 16 }"#, r#"key = "fp16""#));
    assert_eq!(e.kind, Syntax);
    assert_eq!(e.field, "tier[0].key", "{e}");
    assert!(e.message.contains(r#"a scheme is a table like { scheme = "fp16" }"#), "{e}");
    assert!(!e.message.contains("RawScheme"), "{e}");
}

#[test]
fn huge_integers_are_located_and_leak_no_rust_types() {
    let e = fail(&edit(SMALL, "tokens = 16", "tokens = 100000000000000000000000"));
    assert_eq!(e.line, 9, "{e}");
    assert!(e.message.contains("out of range"), "{e}");
    assert!(!e.message.contains("i128") && !e.message.contains("i64"), "{e}");
}

#[test]
fn deeply_nested_toml_gives_a_short_message() {
    let src = format!("{SMALL}\nx = {}{}\n", "[".repeat(100_000), "]".repeat(100_000));
    let e = fail(&src);
    let shown = e.to_string();
    assert!(shown.len() < 1000, "{} bytes: {}", shown.len(), &shown[..300]);
}

/// BASE with its two live tiers rotated: `hi` at 4 bits, `lo` at 3, both with seed 1.
fn rotated_base() -> String {
    let s = edit(BASE, r#"key = { scheme = "int", bits = 8, block = 16 }"#, r#"key = { scheme = "rotated", bits = 4, seed = 1 }"#);
    let s = edit(&s, r#"value = { scheme = "int", bits = 8, group = 32 }"#, r#"value = { scheme = "rotated", bits = 4, seed = 1 }"#);
    let s = edit(&s, r#"key = { scheme = "int", bits = 4, block = 64 }"#, r#"key = { scheme = "rotated", bits = 3, seed = 1 }"#);
    edit(&s, r#"value = { scheme = "int", bits = 4, group = 32 }"#, r#"value = { scheme = "rotated", bits = 3, seed = 1 }"#)
}

#[test]
fn rotated_tiers_share_one_basis() {
    use kvforge_spec::Basis;
    assert_eq!(parse_in(BASE, Path::new(".")).unwrap().basis(), Basis::Identity);
    let s = parse_in(&rotated_base(), Path::new(".")).unwrap();
    assert_eq!(s.basis(), Basis::Hadamard { seed: 1 });
    assert_eq!(s.tier("hi").unwrap().key.to_string(), "rotated 4-bit (Hadamard seed 0x1)");
    // The default seed.
    let s = parse_in(&rotated_base().replace(", seed = 1 }", " }"), Path::new(".")).unwrap();
    assert_eq!(s.basis(), Basis::Hadamard { seed: 0x5eed });
    assert_eq!(s.tier("lo").unwrap().value.to_string(), "rotated 3-bit (Hadamard seed 0x5eed)");
}

#[test]
fn rotated_seeds_that_disagree_are_located() {
    let e = fail(&edit(&rotated_base(), r#"key = { scheme = "rotated", bits = 3, seed = 1 }"#, r#"key = { scheme = "rotated", bits = 3, seed = 2 }"#));
    check(&e, Invalid, 19, 46, "tier[1].key.seed", &["tier `lo` key stores rows in the Hadamard seed 0x2 basis but tier `hi` key in the Hadamard seed 0x1 basis", "give every rotated tier the same `seed`"]);
    // A side without `seed` takes the default, and the error points at its table.
    let e = fail(&edit(&rotated_base(), r#"value = { scheme = "rotated", bits = 4, seed = 1 }"#, r#"value = { scheme = "rotated", bits = 4 }"#));
    check(&e, Invalid, 15, 9, "tier[0].value", &["Hadamard seed 0x5eed basis but tier `hi` key in the Hadamard seed 0x1 basis"]);
}

#[test]
fn rotated_fields_are_checked() {
    let e = fail(&edit(BASE, r#"key = { scheme = "int", bits = 4, block = 64 }"#, r#"key = { scheme = "rotated", bits = 3, block = 64 }"#));
    check(&e, Invalid, 19, 47, "tier[1].key.block", &["scheme `rotated` takes no `block`; its fields: bits, seed"]);
    let e = fail(&edit(BASE, r#"key = { scheme = "int", bits = 4, block = 64 }"#, r#"key = { scheme = "rotated", bits = 5 }"#));
    check(&e, Invalid, 19, 36, "tier[1].key.bits", &["bits 5 is not supported for `rotated`; valid: 4, 3, 2"]);
    let e = fail(&edit(BASE, r#"key = { scheme = "int", bits = 4, block = 64 }"#, r#"key = { scheme = "rotated" }"#));
    check(&e, Invalid, 19, 7, "tier[1].key.bits", &["scheme `rotated` needs `bits` (4, 3 or 2)"]);
    let e = fail(&edit(BASE, r#"key = { scheme = "int", bits = 4, block = 64 }"#, r#"key = { scheme = "rotated", bits = 3, seed = -1 }"#));
    check(&e, Invalid, 19, 46, "tier[1].key.seed", &["seed -1 is not supported; valid: 0 to 0xffffffff"]);
}

#[test]
fn certified_decode_refuses_a_rotated_basis() {
    let e = fail(&format!("{}certified = true\n", rotated_base()));
    check(&e, Invalid, 29, 13, "kernels.certified", &["certified decode does not support a rotated basis yet", "tier `hi` key stores K and V in the Hadamard seed 0x1 basis", "set `certified = false`"]);
    assert!(parse_in(&format!("{}certified = false\n", rotated_base()), Path::new(".")).is_ok());
}
