//! One field list per kernel parameter struct, and one table of the constants kernels and host
//! share. Both the C++ side (`params.cuh`) and the `#[repr(C)]` Rust side (`params.rs`) are
//! rendered from them, so they cannot drift.

/// A field: name, C++ type, Rust type, doc.
pub struct Field {
    pub name: &'static str,
    pub ctype: &'static str,
    pub rust: &'static str,
    pub doc: &'static str,
}

pub struct ParamStruct {
    pub name: &'static str,
    pub doc: &'static str,
    pub fields: &'static [Field],
}

const fn f(name: &'static str, ctype: &'static str, rust: &'static str, doc: &'static str) -> Field {
    Field { name, ctype, rust, doc }
}

/// Entries of the per-tier pointer tables (`side`).
pub const MAX_TIERS: usize = 16;
/// Side-table slots per tier (`side`): the codecs' declared tables.
pub const SIDE_SLOTS: usize = kvforge_spec::codecs::SIDE_SLOTS;
const _: () = assert!(SIDE_SLOTS == 2, "params' `side` field is rendered as [[u64; 2]; 16]");

pub const PARAMS: &[ParamStruct] = &[
    ParamStruct {
        name: "DecodeParams",
        doc: "Arguments of every decode kernel.",
        fields: &[
            f("q", "const void*", "u64", "[batch][num_kv_heads * gqa][head_dim] queries, spec dtype"),
            f("out", "void*", "u64", "[batch][num_kv_heads * gqa][head_dim] output when num_splits == 1"),
            f("partial_out", "float*", "u64", "[num_splits][batch][num_q_heads][head_dim] split partial outputs"),
            f("partial_lse", "float*", "u64", "[num_splits][batch][num_q_heads] split log-sum-exp (natural log)"),
            f("arena", "const u8*", "u64", "page arena base"),
            f("page_offsets", "const u64*", "u64", "byte offset of every page in the arena"),
            f("page_indptr", "const u32*", "u64", "[batch * num_kv_heads + 1] page ranges of every (sequence, kv head)"),
            f("page_info", "const u32*", "u64", "per page: tier | tokens << 8, from the runtime's page table (tokens PAGE_LIVE_LENGTH: as many as the header holds); sizes the staging copy, checked against the staged header"),
            f("side", "const void* side[MAX_TIERS][SIDE_SLOTS]", "[[u64; 2]; 16]", "per tier and slot: the side table the tier's codecs declare at that slot (kvforge-spec `Codec::side_tables`, keys' then values': spherical codebooks [num_kv_heads][groups][entries][group] and radius scales [num_kv_heads][groups], mixed-key channel orders [num_kv_heads][2][head_dim]), null where unset"),
            f("page_lse", "float*", "u64", "optional per page: log2 Σ_heads Σ_tokens 2^logit, an importance signal for controllers"),
            f("page_head_lse", "float*", "u64", "optional [page][gqa]: log2 Σ_tokens 2^logit per query head"),
            f("block_delta", "float*", "u64", "optional [page][page tokens / 16][gqa] (certified decode, block layout): per 16-token block the logit error bound Δ_b = ½ Σ_c |q_c| σ_c / sqrt(d) of the key block holding it (0 for exact keys or blocks past the page's tokens, +inf where the scheme states no bound)"),
            f("error_flags", "u32*", "u64", "ERR_* bits set by the kernel"),
            f("sm_scale", "float", "f32", "softmax scale, usually 1/sqrt(head_dim)"),
            f("batch", "int", "i32", "sequences"),
            f("num_kv_heads", "int", "i32", "kv heads"),
            f("num_splits", "int", "i32", "split-K factor; 1 writes `out` directly"),
            // Last: appended after the fields the plain entry reads, so that their offsets (and
            // its code) stayed as they were.
            f("page_warp_lse", "float*", "u64", "[page][warps][gqa] scratch of a tracked decode in the per-warp layout (launch shape `warp_lse_per_page` floats per page, else unused): every warp's log2 Σ_tokens 2^logit per query head, folded into page_lse / page_head_lse after the page loop"),
            f("block_head_lse", "float*", "u64", "optional [page][page tokens / 16][gqa] (certified decode, block layout): log2 Σ_tokens 2^logit of every 16-token block per query head (-inf past the page's tokens)"),
            f("promoted_offsets", "const u64*", "u64", "optional per page (certified phase 2): where page_info carries a promoted-block mask (bits 16-23: block b of 16 tokens is read from the fp16 original), the original's offset from the arena base, wrapping"),
            f("rot_seed", "unsigned int", "u32", "seed of the rotated basis (kvforge-spec `Basis::Hadamard`): decode rotates q and the output with its signs; unused by specs without one"),
        ],
    },
    ParamStruct {
        name: "TranscodeParams",
        doc: "Arguments of every transcode (and encode) kernel: one CTA per page.",
        fields: &[
            f("arena", "u8*", "u64", "page arena base"),
            f("src_offsets", "const u64*", "u64", "[num_pages] source page offsets"),
            f("dst_offsets", "const u64*", "u64", "[num_pages] destination page offsets"),
            f("kv_heads", "const u32*", "u64", "[num_pages] kv head of each page (selects its slice of the side tables)"),
            f("side", "const void* side[MAX_TIERS][SIDE_SLOTS]", "[[u64; 2]; 16]", "as in DecodeParams"),
            f("error_flags", "u32*", "u64", "ERR_* bits set by the kernel"),
            f("num_pages", "int", "i32", "pages to transcode"),
        ],
    },
    ParamStruct {
        name: "MassWindowParams",
        doc: "Arguments of the importance-window fold: one CTA per (decode entry, kv head).",
        fields: &[
            f("page_lse", "const float*", "u64", "per page of the decode: log2 Σ_heads Σ_tokens 2^logit (DecodeParams::page_lse); null in a combine that does not fold"),
            f("page_indptr", "const u32*", "u64", "[batch * num_kv_heads + 1] the decode's page ranges"),
            f("window", "float*", "u64", "[sequence slots][num_kv_heads][capacity] max log2 share of every page since the host last read it (NaN: not observed)"),
            f("slots", "const u32*", "u64", "[batch] window slot (cache sequence id) of every decode entry"),
            f("num_kv_heads", "int", "i32", "kv heads"),
            f("capacity", "int", "i32", "pages per window row; the host grows the window before a decode has more"),
        ],
    },
    ParamStruct {
        name: "CombineParams",
        doc: "Arguments of the split-K combine kernel: one CTA per (sequence, query head), then one per (sequence, kv head) folding the importance window.",
        fields: &[
            f("partial_out", "const float*", "u64", "[num_splits][rows][head_dim]"),
            f("partial_lse", "const float*", "u64", "[num_splits][rows]"),
            f("out", "void*", "u64", "[rows][head_dim] output, spec dtype"),
            f("lse", "float*", "u64", "optional [rows] log-sum-exp (natural log)"),
            f("rows", "int", "i32", "batch * num_q_heads"),
            f("num_splits", "int", "i32", "splits to merge"),
            f("fold_groups", "int", "i32", "batch * num_kv_heads CTAs after the rows that fold `fold` (0: no fold)"),
            f("fold", "MassWindowParams", "MassWindowParams", "RDR's importance window fold of the same decode (fold.page_lse null: none)"),
        ],
    },
    ParamStruct {
        name: "CertSelectParams",
        doc: "Certified decode, selector: one CTA per (sequence, kv head) group of a phase-1 plan.",
        fields: &[
            f("block_head_lse", "const float*", "u64", "[block][gqa] phase-1 log2 Σ_tokens 2^logit of every 16-token block and query head"),
            f("page_indptr", "const u32*", "u64", "[groups + 1] page ranges of every (sequence, kv head); block ranges are blocks_per_page times them"),
            f("page_info", "const u32*", "u64", "phase-1 page table: tier | tokens << 8"),
            f("page_offsets", "const u64*", "u64", "phase-1 page table: byte offsets in the arena"),
            f("orig_offsets", "const u64*", "u64", "per page: its fp16 original (tier 2, pinned, read over UVA) as an offset from the arena base, wrapping; read for quantised pages only"),
            f("group_seeds", "const u64*", "u64", "[groups] hashed exploration seed of every group"),
            f("force_exact", "const u8*", "u64", "optional [groups]: nonzero serves every quantised page of the group from tier 2 (rungs 3 and 4)"),
            f("out_page_offsets", "u64*", "u64", "phase-2 page table written here: offsets"),
            f("out_page_info", "u32*", "u64", "phase-2 page table written here: tier | tokens << 8 | promoted-block mask << 16"),
            f("out_promoted_offsets", "u64*", "u64", "phase-2 page table written here: the original's offset of a page served in part (mask set)"),
            f("block_state", "u8*", "u64", "per block written here: 0 quantised, 1 promoted, 2 explored (blocks of tail-tier pages 0)"),
            f("weights", "u64*", "u64", "[block][gqa] scratch: the blocks' fixed-point weights, computed once per step"),
            f("coverage", "double", "f64", "τ_cov: exact share of every query head's estimated mass"),
            f("explore", "double", "f64", "fraction of quantised blocks explored (⌈explore · blocks⌉, at most the unpromoted ones)"),
            f("min_blocks", "u32", "u32", "K_min"),
            f("max_blocks", "u32", "u32", "K_max"),
            f("groups", "int", "i32", "batch × kv heads"),
            f("blocks_per_page", "int", "i32", "page tokens / 16"),
        ],
    },
    ParamStruct {
        name: "CertBoundParams",
        doc: "Certified decode, certificate: one CTA per query head (batch × kv heads × gqa).",
        fields: &[
            f("block_head_lse", "const float*", "u64", "[block][gqa] phase-1 log2 masses"),
            f("block_delta", "const float*", "u64", "[block][gqa] phase-1 key logit bound Δ_b (natural log)"),
            f("block_head_lse2", "const float*", "u64", "[block][gqa] phase-2 log2 masses"),
            f("page_indptr", "const u32*", "u64", "[groups + 1] page ranges (block ranges: blocks_per_page times them)"),
            f("page_info", "const u32*", "u64", "phase-1 page table: tier | tokens << 8"),
            f("block_state", "const u8*", "u64", "per block: 0 quantised, 1 promoted, 2 explored"),
            f("block_eta", "const double*", "u64", "per block: η_b = max_t ‖V_t − V̂_t‖₂ (blocks of quantised pages)"),
            f("group_v_max", "const double*", "u64", "[groups] V_max = max_t ‖V_t‖₂"),
            f("out", "const void*", "u64", "[rows][head_dim] phase-2 output, spec dtype"),
            f("head_f64", "double*", "u64", "[rows][CERT_F64] written here: Δ, α̂, V_max, E_key, E_val, E_round, bound, ‖Ô‖₂"),
            f("head_u32", "u32*", "u64", "[rows][CERT_U32] written here: score-check failures, boundary pages, ranking flag, promoted, explored"),
            f("error_flags", "const u32*", "u64", "the decode kernels' ERR_* bits of this step"),
            f("flags_out", "u32*", "u64", "optional: a copy of *error_flags written here, so one download returns the step"),
            f("guard", "double", "f64", "ε_guard of the score check (natural log)"),
            f("head_dim", "int", "i32", "head dim of `out`"),
            f("rank_depth", "int", "i32", "r of the ranking-consistency and boundary checks; 0 skips them"),
            f("groups", "int", "i32", "batch × kv heads"),
            f("blocks_per_page", "int", "i32", "page tokens / 16"),
        ],
    },
];

/// A constant the kernels and the host share: name, C++ type, Rust type, value, doc.
pub struct Constant {
    pub name: &'static str,
    pub ctype: &'static str,
    pub rust: &'static str,
    pub value: &'static str,
    pub doc: &'static str,
}

const fn c(name: &'static str, ctype: &'static str, rust: &'static str, value: &'static str, doc: &'static str) -> Constant {
    Constant { name, ctype, rust, value, doc }
}

/// Shared constants: rendered into `params.cuh` (`constexpr`) and `params.rs` (`pub const`),
/// so the host reads the kernels' outputs by the numbers the kernels were compiled with.
pub const CONSTANTS: &[Constant] = &[
    c("PAGE_LIVE_LENGTH", "u32", "u32", "255", "tokens field of a page_info entry meaning 'as many tokens as the page header holds' (page tokens are at most 128): a device-resident plan's tail entry, whose header the append kernel keeps current, so the plan is not rewritten per token"),
    c("CERT_BLOCK", "int", "usize", "16", "tokens of a certification block: the unit of Δ_b, η_b, the masses the selector ranks, promotion and the certificate's sums (seed 004's B)"),
    c("CF_DELTA", "int", "usize", "0", "column of CertBoundParams::head_f64: Δ"),
    c("CF_ALPHA", "int", "usize", "1", "column of head_f64: α̂"),
    c("CF_VMAX", "int", "usize", "2", "column of head_f64: V_max"),
    c("CF_EKEY", "int", "usize", "3", "column of head_f64: E_key"),
    c("CF_EVAL", "int", "usize", "4", "column of head_f64: E_val"),
    c("CF_EROUND", "int", "usize", "5", "column of head_f64: E_round"),
    c("CF_BOUND", "int", "usize", "6", "column of head_f64: the bound"),
    c("CF_ONORM", "int", "usize", "7", "column of head_f64: ‖Ô‖₂"),
    c("CERT_F64", "int", "usize", "8", "columns of head_f64"),
    c("CU_DETECT", "int", "usize", "0", "column of CertBoundParams::head_u32: score-check failures"),
    c("CU_BOUNDARY", "int", "usize", "1", "column of head_u32: boundary pages"),
    c("CU_RANKING", "int", "usize", "2", "column of head_u32: ranking flag"),
    c("CU_PROMOTED", "int", "usize", "3", "column of head_u32: promoted blocks"),
    c("CU_EXPLORED", "int", "usize", "4", "column of head_u32: explored blocks"),
    c("CERT_U32", "int", "usize", "5", "columns of head_u32"),
    c("PAGE_QUANTISED", "u8", "u8", "0", "block state written by the selector: read quantised"),
    c("PAGE_PROMOTED", "u8", "u8", "1", "block state: promoted (read from its fp16 original)"),
    c("PAGE_EXPLORED", "u8", "u8", "2", "block state: explored (promoted at random)"),
];

/// Taylor coefficients (ln 2)^k / k!, k = 0..=12, as f64 bit patterns: the certificate's 2^f
/// for f ∈ [0, 1) on the device (`KVF_CERT_EXP2_COEFFS`, a list for an array initialiser) and
/// on the host (`EXP2_COEFFS`).
pub const EXP2_COEFFS: [u64; 13] = [
    0x3ff0000000000000,
    0x3fe62e42fefa39ef,
    0x3fcebfbdff82c58f,
    0x3fac6b08d704a0c0,
    0x3f83b2ab6fba4e77,
    0x3f55d87fe78a6731,
    0x3f2430912f86c787,
    0x3eeffcbfc588b0c7,
    0x3eb62c0223a5c824,
    0x3e7b5253d395e7c4,
    0x3e3e4cf5158b8eca,
    0x3dfe8cac7351bb25,
    0x3dbc3bd650fc2986,
];

/// Renders `params.cuh`.
pub fn render_cuda() -> String {
    let mut s = String::new();
    s.push_str(&format!("// @generated by {} from crates/kvforge-gen/src/params.rs — do not edit\n", kvforge_spec::GENERATOR_VERSION));
    s.push_str("// Kernel parameter structs; the Rust mirror is kernels-generated/params.rs.\n#pragma once\n#include \"kvforge/common.cuh\"\n\nnamespace kvforge {\n");
    for p in PARAMS {
        s.push_str(&format!("\n// {}\nstruct {} {{\n", p.doc, p.name));
        for fl in p.fields {
            let decl = if fl.ctype.contains('[') { fl.ctype.to_string() } else { format!("{} {}", fl.ctype, fl.name) };
            s.push_str(&format!("  {decl};  // {}\n", fl.doc));
        }
        s.push_str("};\n");
    }
    s.push_str("\n// Constants shared with the host.\n");
    for k in CONSTANTS {
        s.push_str(&format!("constexpr {} {} = {};  // {}\n", k.ctype, k.name, k.value, k.doc));
    }
    let coeffs: Vec<String> = EXP2_COEFFS.iter().map(|c| format!("0x{c:016x}ull")).collect();
    s.push_str(&format!("#define KVF_CERT_EXP2_COEFFS {}\n", coeffs.join(", ")));
    s.push_str("\n}  // namespace kvforge\n");
    s
}

/// Renders `params.rs`: `#[repr(C)]` mirrors with device pointers as `u64`.
pub fn render_rust() -> String {
    use quote::{format_ident, quote};
    let structs = PARAMS.iter().map(|p| {
        let name = format_ident!("{}", p.name);
        let doc = p.doc;
        let fields = p.fields.iter().map(|fl| {
            let n = format_ident!("{}", fl.name);
            let t: syn::Type = syn::parse_str(fl.rust).expect("rust type");
            let d = fl.doc;
            quote! { #[doc = #d] pub #n: #t, }
        });
        quote! {
            #[doc = #doc]
            #[repr(C)]
            #[derive(Clone, Copy, Debug, Default, PartialEq)]
            pub struct #name { #(#fields)* }
        }
    });
    let consts = CONSTANTS.iter().map(|k| {
        let n = format_ident!("{}", k.name);
        let t: syn::Type = syn::parse_str(k.rust).expect("rust type");
        let v: syn::Expr = syn::parse_str(k.value).expect("value");
        let d = k.doc;
        quote! { #[doc = #d] pub const #n: #t = #v; }
    });
    let coeffs = EXP2_COEFFS.iter().map(|c| syn::LitInt::new(&format!("0x{c:016x}"), proc_macro2::Span::call_site()));
    let file: syn::File = syn::parse2(quote! {
        #(#structs)*
        #(#consts)*
        #[doc = "Taylor coefficients (ln 2)^k / k!, k = 0..=12, as f64 bit patterns (the certificate's 2^f for f in [0, 1))."]
        pub const EXP2_COEFFS: [u64; 13] = [#(#coeffs),*];
    })
    .expect("params file");
    format!("// @generated by {} from crates/kvforge-gen/src/params.rs — do not edit\n{}", kvforge_spec::GENERATOR_VERSION, prettyplease::unparse(&file))
}
