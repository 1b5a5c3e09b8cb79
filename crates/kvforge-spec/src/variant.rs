//! One id names every kernel: its file, its `extern "C"` symbol, its Rust enum variant, its
//! disk-cache key and its log fields. Nothing else assembles such names.

use std::fmt;

use crate::spec::{Spec, Tier, TierId};

/// Short code of a tier's coding at one head dim, e.g. `ksph16x8b6_vfp16`,
/// `kint8c16f32_vint4g16f16`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TierCode(pub String);

impl TierCode {
    pub fn of(tier: &Tier, d: usize) -> TierCode {
        let (k, v) = (tier.key.codec().code(d), tier.value.codec().code(d));
        TierCode(format!("k{k}_v{v}"))
    }
}

impl fmt::Display for TierCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How a decode kernel runs a format: warps per CTA, the CTAs per SM its launch bounds ask
/// the register allocator to fit, pages in flight and where values accumulate. Part of the
/// variant id (`_w8c2s3t` in its name), so one format compiles under several schedules side by
/// side; the generator chooses the default one of every format (kvforge-gen `schedule::choose`)
/// and derives every other launch fact (shared memory, layout) from format and schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Schedule {
    /// Warps per CTA.
    pub warps: usize,
    /// CTAs per SM of the kernel's `__launch_bounds__` (its register budget).
    pub ctas_per_sm: usize,
    /// Pages in flight per CTA (cp.async stages), at least 2.
    pub stages: usize,
    /// Values accumulate on tensor cores (fp16 probabilities and values) where the tiers
    /// allow; `false`: fp32 on CUDA cores.
    pub tc_values: bool,
}

impl Schedule {
    /// The part of a variant name, e.g. `w8c2s3t` (`f`: fp32 values).
    fn code(&self) -> String {
        format!("w{}c{}s{}{}", self.warps, self.ctas_per_sm, self.stages, if self.tc_values { "t" } else { "f" })
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.code())
    }
}

/// Chooses the schedule of a decode format (spec, tiers, head dim, gqa); see
/// [`Spec::variants_with`].
pub type ScheduleChooser<'a> = dyn Fn(&Spec, &[TierId], usize, usize) -> Schedule + 'a;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// Decode attention over pages of the given tiers (tail included), run under `schedule`.
    Decode { tiers: Vec<TierId>, codes: Vec<TierCode>, gqa: usize, schedule: Schedule },
    /// Re-code one page from `src` to `dst` (encode when `src` is the tail tier).
    Transcode { src: TierId, dst: TierId, src_code: TierCode, dst_code: TierCode },
    /// Merge split-K partial outputs.
    Combine,
    /// Decode-step append: one token per listed sequence, written from device memory into each
    /// (sequence, kv head)'s tail page (rotated into the spec's basis first where it rotates).
    Append,
    /// Fold a decode's per-page masses into RDR's importance window on the device (the same
    /// kernel for every head dim, GQA and dtype of a spec: it reads only `page_lse`).
    MassWindow,
    /// Certified decode (seed 004): per (sequence, kv head), choose the pages phase 2 reads
    /// from their fp16 originals and write phase 2's page table on the device.
    CertSelect { gqa: usize },
    /// Certified decode: per query head, the certificate and the score, ranking and boundary
    /// checks from phase 2's outputs.
    CertBound { gqa: usize },
}

/// A kernel variant.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VariantId {
    pub spec: String,
    pub family: Family,
    pub head_dim: usize,
    pub page_tokens: usize,
    /// `fp16` or `bf16`: queries, outputs and the tail tier.
    pub dtype: &'static str,
}

impl VariantId {
    /// The decode kernel of one format (tiers, head dim, gqa) under `schedule`. The runtime
    /// and the generator take the default schedule from kvforge-gen (`decode_variant`).
    pub fn decode(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, schedule: Schedule) -> VariantId {
        let codes = tiers.iter().filter(|&&t| t != crate::TAIL_TIER).map(|&t| spec.tiers[t as usize].code(d)).collect();
        VariantId::new(spec, Family::Decode { tiers: tiers.to_vec(), codes, gqa, schedule }, d)
    }
    /// The same format under another schedule (decode variants; other families have none and
    /// come back unchanged).
    pub fn with_schedule(&self, s: Schedule) -> VariantId {
        let mut v = self.clone();
        if let Family::Decode { schedule, .. } = &mut v.family {
            *schedule = s;
        }
        v
    }
    /// A decode variant's schedule; `None` for other families.
    pub fn schedule(&self) -> Option<Schedule> {
        match &self.family {
            Family::Decode { schedule, .. } => Some(*schedule),
            _ => None,
        }
    }
    pub fn transcode(spec: &Spec, src: TierId, dst: TierId, d: usize) -> VariantId {
        let src_code = if src == crate::TAIL_TIER { TierCode("tail".into()) } else { spec.tiers[src as usize].code(d) };
        let dst_code = spec.tiers[dst as usize].code(d);
        VariantId::new(spec, Family::Transcode { src, dst, src_code, dst_code }, d)
    }
    pub fn combine(spec: &Spec, d: usize) -> VariantId {
        VariantId::new(spec, Family::Combine, d)
    }
    /// The decode-step append kernel of head dim `d` (tail pages only, so no tier codes).
    pub fn append(spec: &Spec, d: usize) -> VariantId {
        VariantId::new(spec, Family::Append, d)
    }
    /// The importance-window kernel of `spec`; its `head_dim` is 0 (it serves all).
    pub fn mass_window(spec: &Spec) -> VariantId {
        VariantId::new(spec, Family::MassWindow, 0)
    }
    /// The certified-decode selector. Its kernels read per-page masses and page tables only,
    /// so neither head_dim nor page size is part of the id (head_dim is 0).
    pub fn cert_select(spec: &Spec, gqa: usize) -> VariantId {
        VariantId::new(spec, Family::CertSelect { gqa }, 0)
    }
    /// The certified-decode certificate (head_dim is a launch argument; 0 in the id).
    pub fn cert_bound(spec: &Spec, gqa: usize) -> VariantId {
        VariantId::new(spec, Family::CertBound { gqa }, 0)
    }
    fn new(spec: &Spec, family: Family, d: usize) -> VariantId {
        VariantId { spec: spec.name.clone(), family, head_dim: d, page_tokens: spec.page.tokens, dtype: spec.geometry.dtype.name() }
    }

    /// Stable name, e.g. `decode_ksph16x8b6_vfp16_d128_g4_p64_w4c4s2t`. Decode names list the
    /// spec tiers they serve (the tail tier is always served and not named) and end in their
    /// [`Schedule`]; a `bf16` suffix marks bf16 queries.
    pub fn name(&self) -> String {
        let dt = if self.dtype == "fp16" { String::new() } else { format!("_{}", self.dtype) };
        match &self.family {
            Family::Decode { codes, gqa, schedule, .. } => {
                let tiers: Vec<&str> = codes.iter().map(|c| c.0.as_str()).collect();
                let tiers = if tiers.is_empty() { "tail".to_string() } else { tiers.join("__") };
                format!("decode_{tiers}_d{}_g{gqa}_p{}{dt}_{}", self.head_dim, self.page_tokens, schedule.code())
            }
            Family::Transcode { src_code, dst_code, .. } => {
                format!("transcode_{src_code}_to_{dst_code}_d{}_p{}{dt}", self.head_dim, self.page_tokens)
            }
            Family::Combine => format!("combine_d{}{dt}", self.head_dim),
            Family::Append => format!("append_d{}_p{}{dt}", self.head_dim, self.page_tokens),
            Family::MassWindow => "mass_window".to_string(),
            Family::CertSelect { gqa } => format!("certselect_g{gqa}{dt}"),
            Family::CertBound { gqa } => format!("certbound_g{gqa}{dt}"),
        }
    }

    /// The `extern "C"` kernel symbol.
    pub fn symbol(&self) -> String {
        format!("kvf_{}_{}", self.spec, self.name())
    }

    /// A decode module's second entry point, the same decode recording per-page masses; `None`
    /// for other families.
    pub fn tracked_symbol(&self) -> Option<String> {
        matches!(self.family, Family::Decode { .. }).then(|| format!("{}_tracked", self.symbol()))
    }

    /// Decode variants: the certified entry point (per-block masses and Δ_b, promoted blocks
    /// read from their originals; block layout, fp32 values), compiled only into the modules of
    /// specs with `kernels.certified`.
    pub fn certified_symbol(&self) -> Option<String> {
        matches!(self.family, Family::Decode { .. }).then(|| format!("{}_certified", self.symbol()))
    }

    /// Path under `kernels-generated/`.
    pub fn file(&self) -> String {
        format!("{}/{}.cu", self.spec, self.name())
    }

    /// UpperCamelCase, for the Rust variant table.
    pub fn rust_ident(&self) -> String {
        self.name()
            .split('_')
            .filter(|s| !s.is_empty())
            .map(|s| {
                let mut c = s.chars();
                c.next().map(|f| f.to_ascii_uppercase().to_string() + c.as_str()).unwrap_or_default()
            })
            .collect()
    }

    pub fn kind(&self) -> &'static str {
        match self.family {
            Family::Decode { .. } => "decode",
            Family::Transcode { .. } => "transcode",
            Family::Combine => "combine",
            Family::Append => "append",
            Family::MassWindow => "mass_window",
            Family::CertSelect { .. } => "certselect",
            Family::CertBound { .. } => "certbound",
        }
    }

    pub fn gqa(&self) -> Option<usize> {
        match self.family {
            Family::Decode { gqa, .. } | Family::CertSelect { gqa } | Family::CertBound { gqa } => Some(gqa),
            _ => None,
        }
    }

    /// Disk-cache key: everything that changes the compiled binary.
    pub fn cache_key(&self, source: &str, arch: &str, compiler: &str) -> String {
        let mut h = blake3::Hasher::new();
        for part in [crate::GENERATOR_VERSION, &self.symbol(), source, arch, compiler] {
            h.update(part.as_bytes());
            h.update(&[0]);
        }
        format!("{}-{}", self.symbol(), &h.finalize().to_hex()[..16])
    }
}

impl fmt::Display for VariantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.spec, self.name())
    }
}
