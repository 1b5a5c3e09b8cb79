//! The launch schedule of every kernel: threads, CTAs per SM, pipeline stages, shared
//! memory and transcode splits, mirrored by the generated kernels (each `static_assert`s the
//! numbers).

use kvforge_spec::{KernelShape, KeyScheme, SegmentLayout, Spec, Tier, TierId, ValueScheme};

fn align16(x: usize) -> usize {
    x.div_ceil(16) * 16
}

/// Floats of the per-query LUT one kv head's GQA group needs for `tier`.
fn lut_floats_per_head(tier: &Tier, d: usize) -> usize {
    tier.key.codec().lut_floats_per_head(d)
}

/// Floats of the lookup tables of a decode variant's tiers (its GQA group's, all tiers).
fn lut_floats(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize) -> usize {
    tiers.iter().map(|&t| gqa * lut_floats_per_head(&spec.tiers[t as usize], d)).sum()
}

/// Threads per CTA of the transcode kernels (and of decode variants without a shape of their
/// own, see [`decode_shape`]).
pub fn threads(spec: &Spec) -> usize {
    32 * spec.kernels.warps
}

/// Launch shape of a decode variant: the spec's `kernels.dense` for variants whose tiers (the
/// tail aside) are all dense, else `kernels.warps` / `ctas_per_sm`.
pub fn decode_shape(spec: &Spec, tiers: &[TierId]) -> KernelShape {
    let dense = |t: &Tier| matches!(t.key, KeyScheme::Dense(_)) && matches!(t.value, ValueScheme::Dense(_));
    let mut own = tiers.iter().map(|&t| &spec.tiers[t as usize]).filter(|t| t.id != kvforge_spec::TAIL_TIER).peekable();
    match spec.kernels.dense {
        Some(shape) if own.peek().is_some() && own.all(dense) => shape,
        _ => KernelShape { warps: spec.kernels.warps, ctas_per_sm: spec.kernels.ctas_per_sm },
    }
}

/// Threads per CTA of a decode variant.
pub fn decode_threads(spec: &Spec, tiers: &[TierId]) -> usize {
    32 * decode_shape(spec, tiers).warps
}

/// The entry points of a decode module, as far as their shapes differ. The plain and tracked
/// entries take the spec's `kernels.tensor_core_values` (the per-warp layout where the tiers
/// allow it); the certified entry always runs the block layout with fp32 values on CUDA cores,
/// the arithmetic the certificate's E_round covers (fp16 rounding of p and of dequantised V on
/// the tensor-core value path is not), so a spec need not give up tensor-core values in its
/// plain decode to be certified. Mirrored by the `CertCfg` of decode.cu.tera.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// `<symbol>` and `<symbol>_tracked`.
    Decode,
    /// `<symbol>_certified`.
    Certified,
}

impl Entry {
    /// Whether this entry accumulates values on tensor cores where its tiers allow.
    pub fn tc_values(self, spec: &Spec) -> bool {
        self == Entry::Decode && spec.kernels.tensor_core_values
    }
}

/// Shared memory of one SM on sm_80/sm_90 (bytes), and what the driver reserves per CTA.
const SMEM_PER_SM: usize = 228 * 1024;
const SMEM_RESERVED_PER_CTA: usize = 1024;

/// CTAs per SM a decode variant is built for, before shared memory has its say: the spec's
/// `kernels.ctas_per_sm`, and the default 512 threads per SM where the accumulators need the
/// registers (gqa 8, and the per-warp layout above head_dim 128: one CTA; other variants above
/// head_dim 128).
fn target_ctas(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, entry: Entry) -> usize {
    let default = (512 / decode_threads(spec, tiers)).max(1);
    // The per-warp layout at head_dim > 128 holds 64 accumulators and 32-pair key and value
    // fragments per thread: ~150 registers (at 128 it spilled 0.5 KB per thread).
    if gqa >= 8 || (d > 128 && per_warp(spec, tiers, d, gqa, entry)) {
        1
    } else if d > 128 {
        default
    } else {
        decode_shape(spec, tiers).ctas_per_sm.max(1)
    }
}

/// CTAs per SM the decode kernel asks the register allocator to fit (`__launch_bounds__`):
/// [`target_ctas`], where it exceeds the default 512 threads per SM only as far as the
/// variant's shared memory lets the CTAs reside (a register budget for CTAs that cannot run
/// only costs spills).
pub fn min_blocks(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, entry: Entry) -> usize {
    let default = (512 / decode_threads(spec, tiers)).max(1);
    let fit = SMEM_PER_SM / (decode_smem(spec, tiers, d, gqa, entry) + SMEM_RESERVED_PER_CTA);
    target_ctas(spec, tiers, d, gqa, entry).min(fit.max(default)).max(1)
}

/// Mirror of `IntKey::bfrag_bytes`: integer keys whose block spans several 16-token m-tiles
/// fold the query with the block's scales once per page into shared memory (fp16 high and low
/// parts of q · scale in mma fragment order, then the zero terms per block, channel part, head).
fn bfrag_bytes(spec: &Spec, tier: &Tier, d: usize, gqa: usize) -> usize {
    let p = spec.page.tokens;
    match &tier.key {
        KeyScheme::Int { block, .. } if *block >= 32 => {
            let kp = if spec.kernels.warps >= 2 * (p / 16) { 2 } else { 1 };
            4 * gqa * (p / block).max(1) * (d + kp)
        }
        _ => 0,
    }
}

/// Whether a tier can take the per-warp decode layout (`Key::WARP && Value::WARP` of its
/// codecs in codecs.cuh): fp16 keys or integer keys whose scale block spans the page (channel
/// pairs 2e, 2e + 1 per fragment, scales loaded once per page), and values whose groups hold a
/// lane's head_dim / 8 channels.
fn warp_tier(tier: &Tier, d: usize, p: usize) -> bool {
    tier.key.codec().per_warp_capable(d, p) && tier.value.codec().per_warp_capable(d, p)
}

/// Mirror of `WarpPlan<Cfg>::ON`: whether a decode variant runs the per-warp layout (each warp
/// owns 8-token octets with its own online softmax; see decode.cuh). Variants with an integer
/// key tier whose every tier has fp16 or integer keys and values.
pub fn per_warp(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, entry: Entry) -> bool {
    let p = spec.page.tokens;
    let ts: Vec<&Tier> = tiers.iter().map(|&t| &spec.tiers[t as usize]).collect();
    entry.tc_values(spec)
        && gqa <= 8
        && p % 8 == 0
        && p >= 4 * spec.kernels.warps
        && d % 64 == 0
        && ts.iter().all(|t| warp_tier(t, d, p))
        && ts.iter().any(|t| matches!(t.key, KeyScheme::Int { .. }))
}

/// Mirror of `DecodeCta::WARP_LSE_PER_PAGE`: floats per page of `DecodeParams::page_warp_lse`
/// that the tracked entry of a decode variant needs. In the per-warp layout every warp stores
/// its log2 mass of each query head of a page there, to be folded after the page loop (so the
/// fold holds no registers in it); the block layout needs none.
pub fn warp_lse_per_page(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize) -> usize {
    if per_warp(spec, tiers, d, gqa, Entry::Decode) {
        decode_threads(spec, tiers) / 32 * gqa
    } else {
        0
    }
}

/// Mirror of `WarpPlan<Cfg>::QFRAG_BYTES`: the per-warp layout's query fragments, fp16 high
/// and low parts of head_dim / 4 channels for each lane of the heads (4 per head).
fn qfrag_bytes(d: usize, gqa: usize) -> usize {
    4 * gqa * d
}

/// Mirror of `DecodeSmem<Cfg>::TOTAL`.
pub fn decode_smem(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, entry: Entry) -> usize {
    decode_fixed_smem(spec, tiers, d, gqa, entry) + nstage(spec, tiers, d, gqa, entry) * stage_bytes(spec, tiers, d)
}

/// Shared memory of a decode CTA besides its page stages: queries, lookup tables, scores,
/// softmax statistics, the output reduction and the key/query fragments.
fn decode_fixed_smem(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, entry: Entry) -> usize {
    let p = spec.page.tokens;
    let ts: Vec<&Tier> = tiers.iter().map(|&t| &spec.tiers[t as usize]).collect();
    let lut = lut_floats(spec, tiers, d, gqa);
    let bfrag = if per_warp(spec, tiers, d, gqa, entry) { qfrag_bytes(d, gqa) } else { ts.iter().map(|t| bfrag_bytes(spec, t, d, gqa)).max().unwrap_or(0) };
    align16(gqa * d * 4) + align16(lut * 4) + align16(gqa * p * 4) + align16(4 * gqa * 4) + align16(gqa * d * 4) + align16(bfrag)
}

/// Bytes of one pipeline stage: the page header and the largest staged segment (tail pages,
/// tier 0, are read in place from global memory, so they do not size the stages).
fn stage_bytes(spec: &Spec, tiers: &[TierId], d: usize) -> usize {
    let seg = tiers
        .iter()
        .map(|&t| &spec.tiers[t as usize])
        .filter(|t| t.id != kvforge_spec::TAIL_TIER)
        .map(|t| SegmentLayout::new(t, d, spec.page.tokens, spec.page.alignment).bytes)
        .max()
        .unwrap_or(0);
    kvforge_spec::HEADER_BYTES + align16(seg)
}

/// Pages in flight per decode CTA (`Cfg::NSTAGE` of the generated kernel; the one place this
/// is decided), 2 to 16:
/// - the spec's `kernels.stage_kib` budget when it gives one (plain and tracked entries);
/// - integer and dense pages stream at a bandwidth that grows with the bytes in flight, so
///   they take as many stages as fit in the CTA's share of the SM's shared memory
///   ([`target_ctas`] CTAs per SM, at least 2), at most 100 KiB (H100, per-warp rdkv b8/b4: 1.08-1.21x
///   faster than with 4-5 stages; rdkv at 4 warps × 4 CTAs: stages sized to the share let the
///   fourth CTA reside);
/// - variants with spherical tiers are bound by their lookup-table path and want CTAs per SM
///   more than depth: as many stages as fit in 48 KiB, 2 to 8 (H100, spherical low at batch 64:
///   0.90x the time of the deep rule; 2 stages instead of 3 for d128 pages, 2026-11-26:
///   spherical high / mid at 128K × 64 9.15 / 8.98 → 6.53 / 6.47 ms, low unchanged, batch 1
///   and 8 within ±3% but high at 1 × 32K +8%).
pub fn nstage(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, entry: Entry) -> usize {
    let stage = stage_bytes(spec, tiers, d);
    let lut = lut_floats(spec, tiers, d, gqa);
    // The spec's budget is for the plain and tracked entries; the certified entry holds more
    // registers, runs two CTAs per SM whatever its shared memory, and wants depth (certified
    // q8k4v at `stage_kib = 64`: phase 1 at 1 × 32K 94 → 118 µs with 3 stages instead of 5).
    match spec.kernels.stage_kib.filter(|_| entry == Entry::Decode) {
        Some(kib) => (kib * 1024 / stage).clamp(2, 16),
        None if lut == 0 => {
            // At least two CTAs share the SM's stages even where the registers ask for one
            // (gqa 8, wide heads): two resident CTAs hide each other's barrier and prologue.
            let ctas = target_ctas(spec, tiers, d, gqa, entry).max(2);
            let share = (SMEM_PER_SM / ctas).saturating_sub(SMEM_RESERVED_PER_CTA + decode_fixed_smem(spec, tiers, d, gqa, entry));
            (share.min(100 * 1024) / stage).clamp(2, 16)
        }
        None => (48 * 1024 / stage).clamp(2, 8),
    }
}

/// Floats each thread of a transcode CTA dequantises per slice: the slice a CTA codes is 8 ×
/// its threads (1024 floats at 4 warps), so a page splits over a few CTAs at head_dim 64 and
/// more at 128 and 256.
const TRANSCODE_FLOATS_PER_THREAD: usize = 8;

/// Whether the destination key codec codes a transcode slice as whole channels
/// (`Key::SLICE_CHANNELS`: a scale and zero per channel per block of tokens) rather than
/// whole tokens.
pub fn slices_channels(dst: &Tier) -> bool {
    dst.key.codec().slices_channels()
}

/// CTAs per page of a transcode launch (`Cfg::SPLIT` of the generated kernel; the one place
/// this is decided). A controller launch moves a few pages: one CTA per page left the GPU idle
/// and each page one long latency chain (46-52 µs per launch, H100). The largest power of two
/// whose slices (P·D / split floats) still give every thread [`TRANSCODE_FLOATS_PER_THREAD`]
/// floats, and cut whole tokens (P % split) and, for per-channel destination keys, whole
/// 8-channel chunks (D % 8·split).
pub fn transcode_split(spec: &Spec, dst: &Tier, d: usize) -> usize {
    let p = spec.page.tokens;
    let slice = TRANSCODE_FLOATS_PER_THREAD * threads(spec);
    let fits = |s: usize| p % s == 0 && (!slices_channels(dst) || d % (8 * s) == 0);
    let mut split = 1;
    while 2 * split * slice <= p * d && fits(2 * split) {
        split *= 2;
    }
    split
}

/// Scratch bytes the destination key codec needs when encoding one key slice: integer and
/// mixed keys 2 · NBLK · (D / split) floats, spherical keys (P / split) · NG ints.
pub fn transcode_scratch(spec: &Spec, dst: &Tier, d: usize) -> usize {
    let p = spec.page.tokens;
    let split = transcode_split(spec, dst, d);
    dst.key.codec().transcode_scratch(d, p, split)
}

/// Mirror of `TranscodeSmem<Cfg>::TOTAL`: one slice of P·D / split floats and the scratch.
pub fn transcode_smem(spec: &Spec, dst: &Tier, d: usize) -> usize {
    align16(spec.page.tokens * d / transcode_split(spec, dst, d) * 4) + align16(transcode_scratch(spec, dst, d))
}

