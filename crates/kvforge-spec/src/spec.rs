//! The validated IR and the validation that produces it.

use std::path::Path;

use toml::Spanned;

use crate::basis::Basis;
use crate::codecs::{self, ParseCtx};
use crate::error::{Locator, SpecError, SpecErrorKind};
use crate::layout::SegmentLayout;
use crate::raw::{RawScheme, RawShape, RawSpec};
use crate::scheme::{DType, KeyScheme, ValueScheme};
use crate::variant::{ScheduleChooser, TierCode, VariantId};

/// Index of a tier in [`Spec::tiers`]; it is the `tier` byte of every page header.
pub type TierId = u8;
/// The implicit tail tier: dense K and V in the query dtype. New tokens land in a tail page;
/// when it fills, the encode kernel writes it in its target tier (seed 004 P1). Every decode
/// variant serves it.
pub const TAIL_TIER: TierId = 0;

/// Largest LUT (all spherical tiers of one decode combination, f32, largest GQA) the decode
/// kernel keeps in shared memory.
pub const LUT_BUDGET_BYTES: usize = 64 * 1024;
/// Largest staged page segment (two stages are kept in shared memory).
pub const STAGE_BUDGET_BYTES: usize = 96 * 1024;

#[derive(Clone, Debug, PartialEq)]
pub struct Tier {
    pub id: TierId,
    pub name: String,
    pub key: KeyScheme,
    pub value: ValueScheme,
}

impl Tier {
    pub fn is_drop(&self) -> bool {
        self.key.is_drop()
    }
    /// Payload + metadata bytes per token per head at head dim `d` (page header excluded).
    pub fn bytes_per_token(&self, d: usize, page_tokens: usize) -> f64 {
        (self.key.page_bytes(d, page_tokens) + self.value.page_bytes(d, page_tokens)) as f64 / page_tokens as f64
    }
    pub fn code(&self, d: usize) -> TierCode {
        TierCode::of(self, d)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Geometry {
    pub head_dims: Vec<usize>,
    pub gqa: Vec<usize>,
    pub dtype: DType,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PageOptions {
    pub tokens: usize,
    pub alignment: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct KernelOptions {
    /// Tier sets one decode launch serves (the tail tier is always added).
    pub combinations: Vec<Vec<TierId>>,
    pub split_k: bool,
    pub warps: usize,
    /// Decode launches that serve integer-key tiers accumulate P·V on tensor cores, with the
    /// probabilities and the dequantised values rounded to fp16 (default). `false` keeps fp32
    /// CUDA-core accumulation in the plain and tracked entries too. The certified entry always
    /// accumulates in fp32 (the arithmetic certified decode's E_round assumes, seed 004),
    /// whatever this says.
    pub tensor_core_values: bool,
    /// Whether decode modules carry the certified entry point (`<symbol>_certified`: block
    /// layout, fp32 values, per-block masses and key bounds, promoted blocks from their
    /// originals) that certified decode (seed 004) launches. Default `false`: the entry is a
    /// third kernel per module (NVRTC time), and in modules whose plain entries run the
    /// per-warp layout it is a second layout the register allocator must fit under the same
    /// launch bounds (rdkv at head_dim 256 spills 40-160 B there). Certified decode of a spec
    /// without it is refused with a typed error.
    pub certified: bool,
    /// CTAs per SM the decode kernels of gqa < 8 ask the register allocator to fit
    /// (`__launch_bounds__`; gqa ≥ 8 always asks for one: its accumulators need the registers).
    /// Default: 512 threads per SM. Three CTAs of 8 warps cap registers at 80: the low-bit
    /// integer tiers, which shared memory does not limit, gain from the extra CTA; wider tiers
    /// spill there (docs/perf/NOTES.md).
    pub ctas_per_sm: usize,
    /// Shared memory per decode CTA for its page pipeline (KiB): the stage count is as many
    /// pages as fit (2 to 16). `None`: the generator's rule (kvforge-gen schedule.rs `nstage`: 100 KiB, less
    /// for variants with lookup tables). Fewer warps per CTA with more CTAs per SM want a
    /// smaller budget so that the CTAs fit beside each other. The certified entry keeps the
    /// generator's rule (it runs two CTAs per SM at its register count and wants depth).
    pub stage_kib: Option<usize>,
    /// Shape of the decode launches whose tiers are all dense (fp16/bf16 keys and values):
    /// `None` keeps `warps` / `ctas_per_sm`. A spec tuned for few warps and many CTAs per SM
    /// (the per-warp layout of integer tiers) can give its dense launches the block layout's
    /// shape back: they read whole pages and want deep stages (rdkv's fp16 launch at 4 warps ×
    /// 4 CTAs read at 0.66 of a copy, its 32 KiB pages two stages deep; 0.94 at 8 × 2).
    pub dense: Option<KernelShape>,
    /// Shape of the decode launches of several tiers (a ladder, not counting the tail; dense
    /// launches take `dense`): `None` keeps `warps` / `ctas_per_sm`. A ladder's launch holds
    /// every tier's fragments and spills where a one-tier launch of the same spec fits more
    /// CTAs per SM (rotated: five CTAs per SM for one tier, four for the ladder).
    pub ladder: Option<KernelShape>,
}

/// Warps per CTA and CTAs per SM of a decode launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelShape {
    pub warps: usize,
    pub ctas_per_sm: usize,
}

/// Bounds of `kernels.stage_kib`: a stage pipeline needs two pages of the smallest tiers, and
/// one CTA's shared memory is at most 227 KiB on sm_90 (the rest is fixed regions).
const MIN_STAGE_KIB: i64 = 8;
const MAX_STAGE_KIB: i64 = 200;

/// Resident threads per SM on sm_80 and sm_90.
const MAX_THREADS_PER_SM: usize = 2048;

/// A validated spec. Only this type reaches the generator and the runtime.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub name: String,
    pub description: String,
    /// Path as given (shown in generated headers; keep it relative).
    pub path: String,
    /// blake3 of the spec text and its codebooks.
    pub hash: String,
    pub geometry: Geometry,
    pub page: PageOptions,
    /// `tiers[0]` is the tail tier; then the ladder, most to least precise.
    pub tiers: Vec<Tier>,
    pub kernels: KernelOptions,
}

impl Spec {
    /// Reads and validates a spec file. `shown` is the path used in messages and headers.
    pub fn load(path: &Path) -> Result<Spec, SpecError> {
        let shown = path.display().to_string();
        let src = crate::input::read_text(path, crate::input::MAX_SPEC_BYTES).map_err(|e| SpecError {
            kind: SpecErrorKind::Io,
            file: shown.clone(),
            line: 0,
            column: 0,
            field: String::new(),
            message: format!("cannot read spec: {e}"),
            snippet: String::new(),
        })?;
        Spec::parse(&src, &shown, path.parent().unwrap_or(Path::new(".")))
    }

    /// Parses spec text. Codebook paths resolve against `dir`.
    pub fn parse(src: &str, file: &str, dir: &Path) -> Result<Spec, SpecError> {
        let loc = Locator { file, src };
        let raw: RawSpec = toml::from_str(src).map_err(|e| loc.toml(&e))?;
        Validator { loc: &loc, dir }.spec(raw, src)
    }

    /// The basis every tier of the spec stores K and V in: the one non-identity basis its codecs
    /// need (validation refuses two), else the identity. The runtime maps appended rows, the
    /// query and the output through it ([`Basis`]).
    pub fn basis(&self) -> Basis {
        self.tiers.iter().flat_map(|t| [t.key.codec().basis(), t.value.codec().basis()]).find(|b| !b.is_identity()).unwrap_or_default()
    }

    pub fn tier(&self, name: &str) -> Option<&Tier> {
        self.tiers.iter().find(|t| t.name == name)
    }

    /// Ladder tiers (without the tail), most to least precise.
    pub fn ladder(&self) -> &[Tier] {
        &self.tiers[1..]
    }

    pub fn segment(&self, tier: TierId, d: usize) -> SegmentLayout {
        SegmentLayout::new(&self.tiers[tier as usize], d, self.page.tokens, self.page.alignment)
    }

    /// Every kernel the generator renders for this spec, in a stable order, each decode format
    /// (tiers, head dim, gqa) under the schedule `schedule` gives it. The generator's default
    /// schedules are kvforge-gen's (`kvforge_gen::variants`): schedules depend on shared-memory
    /// plans that only the generator computes.
    pub fn variants_with(&self, schedule: &ScheduleChooser<'_>) -> Vec<VariantId> {
        let mut out = Vec::new();
        for &d in &self.geometry.head_dims {
            for combo in &self.kernels.combinations {
                for &gqa in &self.geometry.gqa {
                    out.push(VariantId::decode(self, combo, d, gqa, schedule(self, combo, d, gqa)));
                }
            }
            let live: Vec<&Tier> = self.tiers.iter().filter(|t| !t.is_drop()).collect();
            for src in &live {
                for dst in live.iter().filter(|t| t.id > src.id) {
                    out.push(VariantId::transcode(self, src.id, dst.id, d));
                }
            }
            if self.kernels.split_k {
                out.push(VariantId::combine(self, d));
            }
            out.push(VariantId::append(self, d));
        }
        out.push(VariantId::mass_window(self));
        out
    }

    /// The certified-decode kernels (selector and certificate) of every gqa, for specs with
    /// `kernels.certified` (none otherwise): not decode variants of the spec's tiers, so
    /// [`Spec::variants_with`] leaves them out; rendered, checked in and precompiled with it.
    pub fn certify_variants(&self) -> Vec<VariantId> {
        if !self.kernels.certified {
            return Vec::new();
        }
        self.geometry.gqa.iter().flat_map(|&g| [VariantId::cert_select(self, g), VariantId::cert_bound(self, g)]).collect()
    }
}

struct Validator<'a> {
    loc: &'a Locator<'a>,
    dir: &'a Path,
}

type R<T> = Result<T, SpecError>;

impl Validator<'_> {
    fn err<T>(&self, span: std::ops::Range<usize>, field: &str, msg: impl Into<String>) -> R<T> {
        Err(self.loc.error(SpecErrorKind::Invalid, Some(span), field, msg))
    }

    /// What a codec's parser sees of one scheme table at `field`.
    fn ctx<'s>(&'s self, raw: &'s Spanned<RawScheme>, field: &'s str, head_dims: &'s [usize], page_tokens: usize, gqa: &'s [usize]) -> ParseCtx<'s> {
        ParseCtx { loc: self.loc, dir: self.dir, raw, field, head_dims, page_tokens, gqa }
    }

    /// Warps (4 or 8; default 4) and CTAs per SM (1 to what 2048 threads allow; default 512
    /// threads per SM) of `[kernels]`, `[kernels.dense]` or `[kernels.ladder]` (`at`).
    fn shape(&self, at: &str, warps: Option<&Spanned<i64>>, ctas: Option<&Spanned<i64>>) -> R<KernelShape> {
        let warps = match warps {
            Some(w) => {
                let v = *w.get_ref();
                if ![4, 8].contains(&v) {
                    return self.err(w.span(), &format!("{at}.warps"), format!("warps {v} is not supported; valid: 4, 8"));
                }
                v as usize
            }
            None => 4,
        };
        let threads = 32 * warps;
        let ctas_per_sm = match ctas {
            Some(c) => {
                let v = *c.get_ref();
                let max = (MAX_THREADS_PER_SM / threads) as i64;
                if !(1..=max).contains(&v) {
                    return self.err(c.span(), &format!("{at}.ctas_per_sm"), format!("{v} CTAs of {threads} threads per SM: valid 1 to {max} (an SM runs at most {MAX_THREADS_PER_SM} threads)"));
                }
                v as usize
            }
            None => (512 / threads).max(1),
        };
        Ok(KernelShape { warps, ctas_per_sm })
    }

    fn spec(&self, raw: RawSpec, src: &str) -> R<Spec> {
        let name = raw.spec.name.get_ref();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') || name.starts_with(|c: char| c.is_ascii_digit()) {
            return self.err(raw.spec.name.span(), "spec.name", format!("spec name `{name}` must be lowercase letters, digits and `_`, starting with a letter (it names files and symbols)"));
        }
        let dtype = match raw.geometry.dtype.get_ref().as_str() {
            "fp16" => DType::Fp16,
            "bf16" => DType::Bf16,
            other => return self.err(raw.geometry.dtype.span(), "geometry.dtype", format!("dtype `{other}` is not supported; valid: fp16, bf16")),
        };
        let head_dims = self.list(&raw.geometry.head_dims, "geometry.head_dims", "head_dim", &[64, 128, 256])?;
        let gqa = self.list(&raw.geometry.gqa, "geometry.gqa", "gqa", &[1, 2, 3, 4, 6, 8])?;

        let tokens = match &raw.page.tokens {
            Some(t) => {
                let v = *t.get_ref();
                if ![16, 32, 64, 128].contains(&v) {
                    return self.err(t.span(), "page.tokens", format!("page tokens {v} is not supported; valid: 16, 32, 64, 128"));
                }
                v as usize
            }
            None => 64,
        };
        let alignment = match &raw.page.alignment {
            Some(a) => {
                let v = *a.get_ref();
                if !(16..=4096).contains(&v) || (v & (v - 1)) != 0 {
                    return self.err(a.span(), "page.alignment", format!("alignment {v} must be a power of two from 16 to 4096"));
                }
                v as usize
            }
            None => 128,
        };
        let page = PageOptions { tokens, alignment };

        let mut tiers = vec![Tier { id: TAIL_TIER, name: "tail".into(), key: KeyScheme::Dense(dtype), value: ValueScheme::Dense(dtype) }];
        if raw.tiers.get_ref().is_empty() {
            return self.err(raw.tiers.span(), "tier", "a spec needs at least one [[tier]]");
        }
        if raw.tiers.get_ref().len() > 15 {
            return self.err(raw.tiers.span(), "tier", "at most 15 tiers are supported");
        }
        for (i, rt) in raw.tiers.get_ref().iter().enumerate() {
            let field = format!("tier[{i}]");
            let tname = rt.name.get_ref().clone();
            if tname.is_empty() || !tname.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return self.err(rt.name.span(), &format!("{field}.name"), format!("tier name `{tname}` must be letters, digits and `_`"));
            }
            if let Some(prev) = tiers.iter().find(|t| t.name == tname) {
                let what = if prev.id == TAIL_TIER { "is reserved for the implicit tail tier".to_string() } else { format!("is already used by tier[{}]", prev.id - 1) };
                return self.err(rt.name.span(), &format!("{field}.name"), format!("tier name `{tname}` {what}; tier names must be unique"));
            }
            let key = codecs::parse_key(&self.ctx(&rt.key, &format!("{field}.key"), &head_dims, tokens, &gqa))?;
            let value = codecs::parse_value(&self.ctx(&rt.value, &format!("{field}.value"), &head_dims, tokens, &gqa))?;
            if key.is_drop() != value.is_drop() {
                let (side, other, span) = if key.is_drop() { ("key", value.to_string(), rt.key.get_ref().scheme.span()) } else { ("value", key.to_string(), rt.value.get_ref().scheme.span()) };
                let other_side = if side == "key" { "value" } else { "key" };
                return self.err(
                    span,
                    &format!("{field}.{side}.scheme"),
                    format!("`drop` must be the scheme of both key and value (a token is evicted whole), but the {other_side} is {other}; make both `drop` or neither"),
                );
            }
            let tier = Tier { id: (i + 1) as TierId, name: tname, key, value };
            for &d in &head_dims {
                if let Some(prev) = tiers.iter().skip(1).find(|t| t.code(d) == tier.code(d)) {
                    return self.err(rt.name.span(), &field, format!("tier `{}` codes exactly like tier `{}` ({}); merge them", tier.name, prev.name, tier.code(d)));
                }
            }
            if let Some(prev) = tiers.last().filter(|t| t.id != TAIL_TIER) {
                if prev.is_drop() {
                    return self.err(rt.name.span(), &field, format!("tier `{}` follows the drop tier `{}`; drop must be last in the ladder", tier.name, prev.name));
                }
                for &d in &head_dims {
                    let (a, b) = (prev.bytes_per_token(d, tokens), tier.bytes_per_token(d, tokens));
                    if b > a {
                        return self.err(
                            rt.name.span(),
                            &field,
                            format!("tier ladder must be ordered from most to least bytes: `{}` costs {b} B/token/head at head_dim {d}, more than `{}` before it ({a} B)", tier.name, prev.name),
                        );
                    }
                }
            }
            for &d in &head_dims {
                let seg = SegmentLayout::new(&tier, d, tokens, alignment);
                if seg.bytes > STAGE_BUDGET_BYTES {
                    return self.err(
                        rt.name.span(),
                        &field,
                        format!("tier `{}` needs a {} B page segment at head_dim {d} with {tokens} tokens; the decode kernel stages at most {STAGE_BUDGET_BYTES} B: use fewer page tokens", tier.name, seg.bytes),
                    );
                }
            }
            tiers.push(tier);
        }

        if tiers.iter().skip(1).all(|t| t.is_drop()) {
            return self.err(raw.tiers.span(), "tier", "the ladder has only the drop tier; add at least one tier that keeps keys and values");
        }

        let basis = self.basis(&raw, &tiers)?;

        let combinations = match &raw.kernels.combinations {
            None => {
                let live: Vec<TierId> = tiers.iter().skip(1).filter(|t| !t.is_drop()).map(|t| t.id).collect();
                let mut c: Vec<Vec<TierId>> = live.iter().map(|&t| vec![TAIL_TIER, t]).collect();
                if live.len() > 1 {
                    c.push(std::iter::once(TAIL_TIER).chain(live.iter().copied()).collect());
                }
                c
            }
            Some(list) => {
                if list.get_ref().is_empty() {
                    return self.err(list.span(), "kernels.combinations", "list at least one tier combination");
                }
                let mut out: Vec<Vec<TierId>> = Vec::new();
                for (ci, combo) in list.get_ref().iter().enumerate() {
                    let mut ids = vec![TAIL_TIER];
                    for n in combo.get_ref() {
                        let field = format!("kernels.combinations[{ci}]");
                        let Some(t) = tiers.iter().skip(1).find(|t| &t.name == n.get_ref()) else {
                            let valid: Vec<&str> = tiers.iter().skip(1).filter(|t| !t.is_drop()).map(|t| t.name.as_str()).collect();
                            return self.err(n.span(), &field, format!("unknown tier `{}`; valid: {}", n.get_ref(), valid.join(", ")));
                        };
                        if t.is_drop() {
                            return self.err(n.span(), &field, format!("tier `{}` is the drop tier: dropped pages are never attended, so no kernel serves them", t.name));
                        }
                        if ids.contains(&t.id) {
                            return self.err(n.span(), &field, format!("tier `{}` is listed twice", t.name));
                        }
                        ids.push(t.id);
                    }
                    ids.sort();
                    if out.contains(&ids) {
                        return self.err(combo.span(), &format!("kernels.combinations[{ci}]"), "this combination is listed twice");
                    }
                    out.push(ids);
                }
                out
            }
        };
        let max_gqa = *gqa.iter().max().unwrap();
        for combo in &combinations {
            for &d in &head_dims {
                let lut: usize = combo.iter().map(|&t| max_gqa * tiers[t as usize].key.codec().lut_floats_per_head(d) * 4).sum();
                if lut > LUT_BUDGET_BYTES {
                    let names: Vec<&str> = combo.iter().skip(1).map(|&t| tiers[t as usize].name.as_str()).collect();
                    let names = names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
                    return match &raw.kernels.combinations {
                        Some(list) => {
                            let ci = combinations.iter().position(|c| c == combo).unwrap_or(0);
                            let span = list.get_ref().get(ci).map_or(list.span(), |c| c.span());
                            self.err(span, &format!("kernels.combinations[{ci}]"), format!(
                                "the lookup tables of tiers {names} in one launch need {lut} B of shared memory at head_dim {d}, gqa {max_gqa}; the budget is {LUT_BUDGET_BYTES} B: use fewer angle bits or split the combination"))
                        }
                        None => self.err(raw.tiers.span(), "kernels.combinations", format!(
                            "the default combinations serve all tiers ({names}) in one launch, whose lookup tables need {lut} B of shared memory at head_dim {d}, gqa {max_gqa}; the budget is {LUT_BUDGET_BYTES} B: list smaller [kernels] combinations or use fewer angle bits")),
                    };
                }
            }
        }
        let KernelShape { warps, ctas_per_sm } = self.shape("kernels", raw.kernels.warps.as_ref(), raw.kernels.ctas_per_sm.as_ref())?;
        let own_shape = |at: &str, raw: &Option<Spanned<RawShape>>| raw.as_ref().map(|d| self.shape(at, d.get_ref().warps.as_ref(), d.get_ref().ctas_per_sm.as_ref())).transpose();
        let dense = own_shape("kernels.dense", &raw.kernels.dense)?;
        let ladder = own_shape("kernels.ladder", &raw.kernels.ladder)?;
        let stage_kib = match &raw.kernels.stage_kib {
            Some(k) => {
                let v = *k.get_ref();
                if !(MIN_STAGE_KIB..=MAX_STAGE_KIB).contains(&v) {
                    return self.err(k.span(), "kernels.stage_kib", format!("{v} KiB of page stages per CTA: valid {MIN_STAGE_KIB} to {MAX_STAGE_KIB} (an SM has 228 KiB of shared memory)"));
                }
                Some(v as usize)
            }
            None => None,
        };
        if let (Some(c), Some((b, by))) = (raw.kernels.certified.as_ref().filter(|c| *c.get_ref()), &basis) {
            return self.err(c.span(), "kernels.certified", format!("certified decode does not support a rotated basis yet ({by} stores K and V in the {b} basis); set `certified = false`"));
        }
        let kernels = KernelOptions {
            combinations,
            split_k: raw.kernels.split_k.unwrap_or(true),
            warps,
            tensor_core_values: raw.kernels.tensor_core_values.unwrap_or(true),
            certified: raw.kernels.certified.as_ref().is_some_and(|c| *c.get_ref()),
            ctas_per_sm,
            stage_kib,
            dense,
            ladder,
        };

        let mut h = blake3::Hasher::new();
        h.update(src.as_bytes());
        for t in &tiers {
            for c in [t.key.codec(), t.value.codec()] {
                if let Some(x) = c.content_hash() {
                    h.update(x.as_bytes());
                }
            }
        }
        let spec = Spec {
            name: name.clone(),
            description: raw.spec.description.clone(),
            path: self.loc.file.to_string(),
            hash: h.finalize().to_hex()[..16].to_string(),
            geometry: Geometry { head_dims, gqa, dtype },
            page,
            tiers,
            kernels,
        };
        crate::constraints::check(&spec, &raw, self.loc)?;
        Ok(spec)
    }

    /// The spec's one non-identity basis and who asked for it (`tier `r4` key`), or a located
    /// error at the first tier side that needs another: pages move between tiers, so every
    /// tier stores rows in one basis.
    fn basis(&self, raw: &RawSpec, tiers: &[Tier]) -> R<Option<(Basis, String)>> {
        let mut found: Option<(Basis, String)> = None;
        for (i, (rt, t)) in raw.tiers.get_ref().iter().zip(&tiers[1..]).enumerate() {
            for (side, b, rs) in [("key", t.key.codec().basis(), &rt.key), ("value", t.value.codec().basis(), &rt.value)] {
                let here = format!("tier `{}` {side}", t.name);
                match &found {
                    _ if b.is_identity() => {}
                    None => found = Some((b, here)),
                    Some((first, by)) if *first != b => {
                        let (span, field) = match rs.get_ref().fields.get("seed") {
                            Some(s) => (s.span(), format!("tier[{i}].{side}.seed")),
                            None => (rs.span(), format!("tier[{i}].{side}")),
                        };
                        return self.err(
                            span,
                            &field,
                            format!(
                                "{here} stores rows in the {b} basis but {by} in the {first} basis; a spec stores every tier in one basis (pages move between tiers): give every rotated tier the same `seed`"
                            ),
                        );
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(found)
    }

    fn list(&self, l: &Spanned<Vec<Spanned<i64>>>, field: &str, noun: &str, valid: &[i64]) -> R<Vec<usize>> {
        let valid_list = valid.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ");
        if l.get_ref().is_empty() {
            return self.err(l.span(), field, format!("list at least one {noun}; valid: {valid_list}"));
        }
        let mut out = Vec::new();
        for v in l.get_ref() {
            if !valid.contains(v.get_ref()) {
                return self.err(v.span(), field, format!("{noun} {} is not supported; valid: {valid_list}", v.get_ref()));
            }
            if out.contains(&(*v.get_ref() as usize)) {
                return self.err(v.span(), field, format!("{noun} {} is listed twice", v.get_ref()));
            }
            out.push(*v.get_ref() as usize);
        }
        Ok(out)
    }
}
