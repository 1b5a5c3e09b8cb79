//! Rust host bindings of one spec: page-layout consts per tier and head dim, and a variant
//! table the runtime and downstream crates dispatch on.

use kvforge_spec::{Family, SegmentLayout, Spec};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use crate::render::{launch_shape, shown_path};

/// How a variant's CUDA source reaches the bindings.
pub enum SourceMode {
    /// `include_str!("<name>.cu")` next to the bindings file (kernels-generated/).
    IncludeStr,
    /// The source as a string literal (the `kernels!` macro).
    Inline,
}

/// Token stream of the bindings module body for `spec`.
pub fn tokens(spec: &Spec, mode: SourceMode) -> Result<TokenStream, crate::RenderError> {
    let spec_name = &spec.name;
    let spec_hash = &spec.hash;
    let spec_path = shown_path(spec);
    let page_tokens = spec.page.tokens;
    let alignment = spec.page.alignment;

    let tier_mods = spec.tiers.iter().map(|tier| {
        let m = format_ident!("{}", tier.name.to_lowercase());
        let id = tier.id;
        let name = &tier.name;
        let key = tier.key.to_string();
        let value = tier.value.to_string();
        let dims = spec.geometry.head_dims.iter().map(|&d| {
            let dm = format_ident!("d{}", d);
            let seg = SegmentLayout::new(tier, d, page_tokens, alignment);
            let seg_bytes = seg.bytes;
            let page_bytes = seg.page_bytes;
            let bpt = tier.bytes_per_token(d, page_tokens);
            let code = tier.code(d).0;
            let arrays = seg.arrays.iter().map(|a| {
                let off = format_ident!("{}_OFFSET", a.name.to_uppercase());
                let by = format_ident!("{}_BYTES", a.name.to_uppercase());
                let (o, b) = (a.offset, a.bytes);
                quote! { pub const #off: usize = #o; pub const #by: usize = #b; }
            });
            quote! {
                #[doc = "Layout at this head dim; offsets are from the segment start (page offset + HEADER_BYTES)."]
                pub mod #dm {
                    pub const CODE: &str = #code;
                    pub const SEGMENT_BYTES: usize = #seg_bytes;
                    pub const PAGE_BYTES: usize = #page_bytes;
                    pub const BYTES_PER_TOKEN: f64 = #bpt;
                    #(#arrays)*
                }
            }
        });
        let doc = format!("Tier `{name}`: K {key}, V {value}.");
        quote! {
            #[doc = #doc]
            pub mod #m {
                pub const ID: u8 = #id;
                pub const NAME: &str = #name;
                #(#dims)*
            }
        }
    });

    // The certify kernels are rendered and checked in with the spec, so they are named here too.
    let variants: Vec<_> = crate::variants(spec).into_iter().chain(spec.certify_variants()).collect();
    let idents: Vec<_> = variants.iter().map(|v| format_ident!("{}", v.rust_ident())).collect();
    let mut infos = Vec::new();
    for v in &variants {
        let shape = launch_shape(spec, v);
        let (name, symbol, kind) = (v.name(), v.symbol(), v.kind());
        let d = v.head_dim;
        let gqa = v.gqa().unwrap_or(0);
        let tiers: Vec<u8> = match &v.family {
            Family::Decode { tiers, .. } => tiers.clone(),
            Family::Transcode { src, dst, .. } => vec![*src, *dst],
            Family::Combine | Family::Append | Family::MassWindow | Family::CertSelect { .. } | Family::CertBound { .. } => vec![],
        };
        let (threads, smem, ctas_per_page, warp_lse_per_page, cert_smem) = (shape.threads, shape.smem_bytes, shape.ctas_per_page, shape.warp_lse_per_page, shape.certified_smem_bytes);
        let source = match mode {
            SourceMode::IncludeStr => {
                let file = format!("{}.cu", v.name());
                quote! { include_str!(#file) }
            }
            SourceMode::Inline => {
                let src = crate::render::render(spec, v)?;
                quote! { #src }
            }
        };
        infos.push(quote! {
            VariantInfo { name: #name, symbol: #symbol, kind: #kind, head_dim: #d, gqa: #gqa, tiers: &[#(#tiers),*], threads: #threads, smem_bytes: #smem, ctas_per_page: #ctas_per_page, warp_lse_per_page: #warp_lse_per_page, certified_smem_bytes: #cert_smem, source: #source }
        });
    }
    let n = variants.len();
    Ok(quote! {
        pub const SPEC_NAME: &str = #spec_name;
        pub const SPEC_PATH: &str = #spec_path;
        pub const SPEC_HASH: &str = #spec_hash;
        pub const PAGE_TOKENS: usize = #page_tokens;
        pub const PAGE_ALIGNMENT: usize = #alignment;
        pub const HEADER_BYTES: usize = 16;

        /// Tiers; `tail` (id 0) holds new tokens until a page fills.
        pub mod tiers { #(#tier_mods)* }

        /// Launch facts and source of one kernel variant.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct VariantInfo {
            pub name: &'static str,
            pub symbol: &'static str,
            /// `decode`, `transcode`, `combine`, `mass_window`, `certselect` or `certbound`.
            pub kind: &'static str,
            pub head_dim: usize,
            /// Query heads per kv head (decode and certify kernels, else 0).
            pub gqa: usize,
            /// Served tier ids (decode) or `[src, dst]` (transcode).
            pub tiers: &'static [u8],
            pub threads: usize,
            pub smem_bytes: usize,
            /// CTAs per page of a transcode launch (grid = pages × this); 1 for other kinds.
            pub ctas_per_page: usize,
            /// Decode: floats per page of the scratch `DecodeParams::page_warp_lse` that the
            /// tracked entry needs (0: none).
            pub warp_lse_per_page: usize,
            /// Decode: dynamic shared memory of the certified entry (block layout, fp32
            /// values), which may differ from `smem_bytes`; 0 for other kinds.
            pub certified_smem_bytes: usize,
            pub source: &'static str,
        }

        /// Every kernel of the spec.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Variant { #(#idents),* }

        impl Variant {
            pub const ALL: [Variant; #n] = [#(Variant::#idents),*];
            pub fn info(self) -> &'static VariantInfo { &INFOS[self as usize] }
        }

        static INFOS: [VariantInfo; #n] = [#(#infos),*];
    })
}

/// The bindings file written to `kernels-generated/<spec>/bindings.rs`.
pub fn render_file(spec: &Spec) -> Result<String, crate::RenderError> {
    let body = tokens(spec, SourceMode::IncludeStr)?;
    let file: syn::File = syn::parse2(body).map_err(|e| crate::RenderError { variant: format!("{}/bindings.rs", spec.name), message: e.to_string() })?;
    Ok(format!(
        "// @generated by {} from {} (spec hash {}) — do not edit\n// Include with `include!` inside a module.\n{}",
        kvforge_spec::GENERATOR_VERSION,
        shown_path(spec),
        spec.hash,
        prettyplease::unparse(&file)
    ))
}
