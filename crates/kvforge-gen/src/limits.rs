//! Device limits a spec's launch schedule must respect, checked when a spec is loaded by the
//! CLI (`kvforge check FILE`, `list`, `generate`, ...), so that a spec `kvforge check` accepts
//! both compiles and launches. The field rules the kernels `static_assert` are in
//! `kvforge_spec::constraints`; this is the half that needs the schedule (shared memory per
//! CTA is the sum of the regions [`crate::schedule`] plans).

use kvforge_spec::{Family, Spec, SpecError, SpecErrorKind};

use crate::render::launch_shape;

/// Dynamic shared memory one CTA may use on sm_90 (227 KiB).
pub const MAX_SMEM_PER_CTA: usize = 227 * 1024;

/// Every kernel of `spec` fits one CTA's shared memory; else an error on the spec file that
/// names the variant, the bytes and the fields to change.
pub fn check(spec: &Spec) -> Result<(), SpecError> {
    for v in crate::variants(spec).into_iter().chain(spec.certify_variants()) {
        let sh = launch_shape(spec, &v);
        let most = sh.smem_bytes.max(sh.certified_smem_bytes);
        if most <= MAX_SMEM_PER_CTA {
            continue;
        }
        let (field, what) = match &v.family {
            Family::Decode { tiers, gqa, .. } => {
                let names: Vec<&str> = tiers.iter().skip(1).map(|&t| spec.tiers[t as usize].name.as_str()).collect();
                (
                    "kernels.combinations",
                    format!(
                        "the decode of tiers {} at head_dim {}, gqa {gqa}, page.tokens {} needs {most} B of shared memory per CTA (two pipeline stages of its largest page segment and its lookup tables), more than the {MAX_SMEM_PER_CTA} B a CTA can have: use fewer page.tokens, split the combination, or drop the head dim or gqa",
                        names.join(", "),
                        v.head_dim,
                        spec.page.tokens
                    ),
                )
            }
            _ => ("page.tokens", format!("kernel {v} needs {most} B of shared memory per CTA, more than the {MAX_SMEM_PER_CTA} B a CTA can have: use fewer page.tokens")),
        };
        return Err(SpecError { kind: SpecErrorKind::Invalid, file: spec.path.clone(), line: 0, column: 0, field: field.to_string(), message: what, snippet: String::new() });
    }
    Ok(())
}
