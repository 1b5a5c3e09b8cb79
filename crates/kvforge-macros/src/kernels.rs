//! `kernels!("specs/<name>.toml")`.

use std::path::Path;

use kvforge_gen::bindings::{tokens, SourceMode};
use kvforge_spec::{KeyScheme, Spec};
use proc_macro2::TokenStream;
use quote::quote;
use syn::parse::{Parse, ParseStream};
use syn::{LitStr, Token};

/// The macro input: one string literal, optionally followed by a comma.
struct Input {
    path: LitStr,
}

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let path = match input.parse::<LitStr>() {
            Ok(p) => p,
            Err(e) => return Err(syn::Error::new(e.span(), "expected the path of a spec as a string literal, e.g. `kernels!(\"specs/spherical.toml\")`")),
        };
        if input.peek(Token![,]) {
            input.parse::<Token![,]>()?;
        }
        if !input.is_empty() {
            return Err(input.error("`kernels!` takes one argument: the path of a spec"));
        }
        Ok(Input { path })
    }
}

pub fn expand(input: TokenStream) -> TokenStream {
    match expand_inner(input) {
        Ok(t) => t,
        Err(e) => e.to_compile_error(),
    }
}

fn expand_inner(input: TokenStream) -> syn::Result<TokenStream> {
    let Input { path } = syn::parse2(input)?;
    let rel = path.value();
    let err = |msg: String| syn::Error::new(path.span(), msg);
    let (file, _) = crate::paths::resolve(&rel, "spec file").map_err(err)?;
    let spec = Spec::load(&file).map_err(|mut e| {
        // Show the path as written, not the absolute one the macro found.
        e.file = rel.clone();
        err(e.to_string())
    })?;
    let body = tokens(&spec, SourceMode::Inline).map_err(|e| err(format!("{rel}: {e}")))?;

    // Every file the expansion depends on, so cargo rebuilds the crate when one changes.
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut deps = vec![crate::paths::lit(&file)];
    for t in &spec.tiers {
        if let KeyScheme::Spherical { codebook, .. } = &t.key {
            let cb = crate::paths::lit(&dir.join(&codebook.path));
            if !deps.contains(&cb) {
                deps.push(cb);
            }
        }
    }
    Ok(quote! {
        #(const _: &[u8] = include_bytes!(#deps);)*
        #body
    })
}
