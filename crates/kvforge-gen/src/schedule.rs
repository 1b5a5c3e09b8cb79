//! Schedules and launch facts of every kernel. A decode variant is a format (tiers, head dim,
//! gqa) under a [`Schedule`] (warps, CTAs per SM, stages, tensor-core values), which is part of
//! its id; [`choose`] picks the default schedule of a format from the rules below and the
//! spec's `kernels.*` overrides. Everything else a kernel's launch needs (the shared-memory
//! plan, the layout, transcode splits) is computed here once from format and schedule and
//! rendered into the kernel's `Cfg`: the device code reads these numbers, it does not
//! recompute them.

use kvforge_spec::{KernelShape, Schedule, SegmentLayout, Spec, Tier, TierId};

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

/// Threads per CTA of the transcode kernels.
pub fn threads(spec: &Spec) -> usize {
    32 * spec.kernels.warps
}

/// Whether a tier stores both keys and values dense (fp16/bf16).
fn is_dense(t: &Tier) -> bool {
    t.key.codec().is_dense() && t.value.codec().is_dense()
}

/// Launch shape a decode format takes by default: the spec's `kernels.dense` for formats whose
/// tiers (the tail aside) are all dense, `kernels.ladder` for formats of several tiers, else
/// `kernels.warps` / `ctas_per_sm`.
pub fn decode_shape(spec: &Spec, tiers: &[TierId]) -> KernelShape {
    let own: Vec<&Tier> = tiers.iter().map(|&t| &spec.tiers[t as usize]).filter(|t| t.id != kvforge_spec::TAIL_TIER).collect();
    match (spec.kernels.dense, spec.kernels.ladder) {
        (Some(shape), _) if !own.is_empty() && own.iter().all(|t| is_dense(t)) => shape,
        (_, Some(shape)) if own.len() > 1 => shape,
        _ => KernelShape { warps: spec.kernels.warps, ctas_per_sm: spec.kernels.ctas_per_sm },
    }
}

/// The entry points of a decode module, as far as their schedules differ. The plain and
/// tracked entries run the variant's [`Schedule`]; the certified entry always runs the block
/// layout with fp32 values on CUDA cores, the arithmetic the certificate's E_round covers (fp16
/// rounding of p and of dequantised V on the tensor-core value path is not), so a spec need not
/// give up tensor-core values in its plain decode to be certified. Its schedule is
/// [`certified`]'s, rendered as the `CertCfg` of decode.cu.tera.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// `<symbol>` and `<symbol>_tracked`.
    Decode,
    /// `<symbol>_certified`.
    Certified,
}

/// Shared memory of one SM on sm_80/sm_90 (bytes), and what the driver reserves per CTA.
const SMEM_PER_SM: usize = 228 * 1024;
const SMEM_RESERVED_PER_CTA: usize = 1024;
/// Most dynamic shared memory one CTA may opt into on sm_90 (227 KiB).
pub const MAX_SMEM_PER_CTA: usize = 227 * 1024;

/// The default schedule of a decode format (tiers, head dim `d`, gqa), i.e. of its plain and
/// tracked entries: [`decode_shape`]'s warps, the spec's `kernels.tensor_core_values`, stages
/// by [`nstage`] and CTAs per SM by [`min_blocks`].
pub fn choose(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize) -> Schedule {
    choose_entry(spec, tiers, d, gqa, decode_shape(spec, tiers).warps, Entry::Decode)
}

/// The schedule of the certified entry in a decode module whose plain entries run `s`: the
/// same warps, fp32 values (the block layout), and stages and CTAs per SM by the generator's
/// rules (the spec's `kernels.stage_kib` is for the plain entries).
pub fn certified(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule) -> Schedule {
    choose_entry(spec, tiers, d, gqa, s.warps, Entry::Certified)
}

fn choose_entry(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, warps: usize, entry: Entry) -> Schedule {
    let tc_values = entry == Entry::Decode && spec.kernels.tensor_core_values;
    let mut s = Schedule { warps, ctas_per_sm: 1, stages: 2, tc_values };
    s.stages = nstage(spec, tiers, d, gqa, &s, entry);
    s.ctas_per_sm = min_blocks(spec, tiers, d, gqa, &s);
    s
}

/// CTAs per SM a decode schedule is built for, before shared memory has its say: the spec's
/// `kernels.ctas_per_sm` (as threads per SM for another warp count), and the default 512 threads per SM where the accumulators need the
/// registers (gqa 8, and the per-warp layout above head_dim 128: one CTA; other variants above
/// head_dim 128).
fn target_ctas(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule) -> usize {
    let default = (512 / (32 * s.warps)).max(1);
    // The per-warp layout at head_dim > 128 holds 64 accumulators and 32-pair key and value
    // fragments per thread: ~150 registers (at 128 it spilled 0.5 KB per thread).
    if gqa >= 8 || (d > 128 && per_warp(spec, tiers, d, gqa, s)) {
        1
    } else if d > 128 {
        default
    } else {
        // The spec's CTAs per SM are for its warps: another warp count keeps its threads per
        // SM (8 warps at rdkv's 4 CTAs asked for 64 registers and spilled 420 B).
        let shape = decode_shape(spec, tiers);
        (shape.ctas_per_sm * shape.warps / s.warps).max(1)
    }
}

/// CTAs per SM the decode kernel asks the register allocator to fit (`__launch_bounds__`):
/// [`target_ctas`], where it exceeds the default 512 threads per SM only as far as the
/// schedule's shared memory lets the CTAs reside (a register budget for CTAs that cannot run
/// only costs spills).
fn min_blocks(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule) -> usize {
    let default = (512 / (32 * s.warps)).max(1);
    let fit = SMEM_PER_SM / (decode_smem(spec, tiers, d, gqa, s).total + SMEM_RESERVED_PER_CTA);
    target_ctas(spec, tiers, d, gqa, s).min(fit.max(default)).max(1)
}

/// Shared memory the block layout's key scorer of `tier` folds the query into once per page
/// (integer keys whose block spans several 16-token m-tiles: `Codec::bfrag_bytes`), at `warps`
/// warps.
fn bfrag_bytes(spec: &Spec, tier: &Tier, d: usize, gqa: usize, warps: usize) -> usize {
    tier.key.codec().bfrag_bytes(d, spec.page.tokens, gqa, warps)
}

/// Whether a tier can take the per-warp decode layout (`Key::WARP && Value::WARP` of its
/// codecs in codecs.cuh): fp16 keys, integer keys whose scale block spans the page (channel
/// pairs 2e, 2e + 1 per fragment, scales loaded once per page) or rotated keys, and values
/// whose groups hold a lane's head_dim / 8 channels (rotated values: whole 8-channel chunks).
fn warp_tier(tier: &Tier, d: usize, p: usize) -> bool {
    tier.key.codec().per_warp_capable(d, p) && tier.value.codec().per_warp_capable(d, p)
}

/// Whether a decode variant runs the per-warp layout (`Cfg::PER_WARP`: each warp owns 8-token
/// octets with its own online softmax; see decode.cuh): tensor-core values, and tiers that all
/// can, one of them with keys that prefer it (integer or rotated keys: `Codec::prefers_per_warp`),
/// or all of them dense at head_dim ≤ 128 (fp16 pages: the tensor-core octets with the query
/// fragments in registers read a page in fewer instructions than the block layout's scorer).
pub fn per_warp(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule) -> bool {
    let p = spec.page.tokens;
    let ts: Vec<&Tier> = tiers.iter().map(|&t| &spec.tiers[t as usize]).collect();
    s.tc_values
        && gqa <= 8
        && p.is_multiple_of(8)
        && p >= 4 * s.warps
        && d.is_multiple_of(64)
        && ts.iter().all(|t| warp_tier(t, d, p))
        && (ts.iter().any(|t| t.key.codec().prefers_per_warp()) || (d <= 128 && ts.iter().all(|t| is_dense(t))))
}

/// Floats per page of `DecodeParams::page_warp_lse` that the tracked entry of a decode variant
/// needs (`Cfg::WARP_LSE_PER_PAGE`). In the per-warp layout every warp stores its log2 mass of
/// each query head of a page there, to be folded after the page loop (so the fold holds no
/// registers in it); the block layout needs none.
pub fn warp_lse_per_page(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule) -> usize {
    if per_warp(spec, tiers, d, gqa, s) {
        s.warps * gqa
    } else {
        0
    }
}

/// The per-warp layout's query fragments: fp16 high and low parts of head_dim / 4 channels for
/// each lane of the heads (4 per head), then, when a tier's keys score on integer tensor cores
/// (`Codec::int8_keys`), their int8 high and low parts.
fn qfrag_bytes(d: usize, gqa: usize, int8: bool) -> usize {
    4 * gqa * d + if int8 { 2 * gqa * d } else { 0 }
}

/// Shared-memory plan of a decode CTA (byte offsets of its regions, rendered as the `SMEM_*`
/// constants of the kernel's `Cfg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeSmem {
    /// Queries, fp32 [gqa][d].
    pub q: usize,
    /// Lookup tables of the spherical tiers.
    pub lut: usize,
    /// Scores [gqa][P].
    pub scores: usize,
    /// Softmax statistics (max, sum, rescale, page mass per head).
    pub stats: usize,
    /// Output reduction [gqa][d] (also a second score part).
    pub out: usize,
    /// Folded integer-key B fragments, or the per-warp layout's query fragments.
    pub bfrag: usize,
    /// The first page stage.
    pub stage: usize,
    /// Bytes of one stage: the page header and the largest staged segment.
    pub stage_bytes: usize,
    /// Dynamic shared memory of the CTA.
    pub total: usize,
}

/// The shared-memory plan of a decode format under schedule `s`.
pub fn decode_smem(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule) -> DecodeSmem {
    let p = spec.page.tokens;
    let ts: Vec<&Tier> = tiers.iter().map(|&t| &spec.tiers[t as usize]).collect();
    let lut = lut_floats(spec, tiers, d, gqa);
    let bfrag = if per_warp(spec, tiers, d, gqa, s) { qfrag_bytes(d, gqa, ts.iter().any(|t| t.key.codec().int8_keys())) } else { ts.iter().map(|t| bfrag_bytes(spec, t, d, gqa, s.warps)).max().unwrap_or(0) };
    let q = 0;
    let lut_off = q + align16(gqa * d * 4);
    let scores = lut_off + align16(lut * 4);
    let stats = scores + align16(gqa * p * 4);
    let out = stats + align16(4 * gqa * 4);
    let bfrag_off = out + align16(gqa * d * 4);
    let stage = bfrag_off + align16(bfrag);
    let stage_bytes = stage_bytes(spec, tiers, d);
    DecodeSmem { q, lut: lut_off, scores, stats, out, bfrag: bfrag_off, stage, stage_bytes, total: stage + s.stages * stage_bytes }
}

/// Bytes of one pipeline stage: the page header and the largest staged segment (tail pages,
/// tier 0, are read in place from global memory, so they do not size the stages).
fn stage_bytes(spec: &Spec, tiers: &[TierId], d: usize) -> usize {
    let seg = tiers.iter().map(|&t| &spec.tiers[t as usize]).filter(|t| t.id != kvforge_spec::TAIL_TIER).map(|t| SegmentLayout::new(t, d, spec.page.tokens, spec.page.alignment).bytes).max().unwrap_or(0);
    kvforge_spec::HEADER_BYTES + align16(seg)
}

/// Pages in flight per decode CTA (`Cfg::NSTAGE` of the generated kernel; the one place this
/// is decided), 2 to 16, for a schedule's warps and values:
/// - the spec's `kernels.stage_kib` budget when it gives one (plain and tracked entries);
/// - integer and dense pages stream at a bandwidth that grows with the bytes in flight, so
///   they take as many stages as fit in the CTA's share of the SM's shared memory
///   ([`target_ctas`] CTAs per SM, at least 2), at most 100 KiB (deeper pipelines were faster
///   for per-warp integer tiers, and stages sized to the share let every CTA reside);
/// - variants with spherical tiers are bound by their lookup-table path and want CTAs per SM
///   more than depth: as many stages as fit in 48 KiB, 2 to 8 (docs/perf/NOTES.md).
fn nstage(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule, entry: Entry) -> usize {
    let stage = stage_bytes(spec, tiers, d);
    let lut = lut_floats(spec, tiers, d, gqa);
    // The spec's budget is for the plain and tracked entries; the certified entry holds more
    // registers, runs two CTAs per SM whatever its shared memory, and wants depth (fewer
    // stages made its phase 1 slower).
    match spec.kernels.stage_kib.filter(|_| entry == Entry::Decode) {
        Some(kib) => (kib * 1024 / stage).clamp(2, 16),
        None if lut == 0 => {
            // At least two CTAs share the SM's stages even where the registers ask for one
            // (gqa 8, wide heads): two resident CTAs hide each other's barrier and prologue.
            let ctas = target_ctas(spec, tiers, d, gqa, s).max(2);
            let share = (SMEM_PER_SM / ctas).saturating_sub(SMEM_RESERVED_PER_CTA + decode_smem(spec, tiers, d, gqa, &Schedule { stages: 0, ..*s }).total);
            (share.min(100 * 1024) / stage).clamp(2, 16)
        }
        None => (48 * 1024 / stage).clamp(2, 8),
    }
}

/// Why a decode schedule cannot run a format.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("{warps} warps: decode kernels run 4 or 8")]
    Warps { warps: usize },
    #[error("{ctas} CTAs of {threads} threads per SM: an SM runs at most 2048 threads")]
    Ctas { ctas: usize, threads: usize },
    #[error("{stages} stages: a pipeline needs 2 to 16")]
    Stages { stages: usize },
    #[error("{bytes} B of shared memory per CTA: at most {MAX_SMEM_PER_CTA}")]
    Smem { bytes: usize },
}

/// Checks that schedule `s` can run a decode format (the bounds the device code assumes).
pub fn check(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize, s: &Schedule) -> Result<(), ScheduleError> {
    if ![4, 8].contains(&s.warps) {
        return Err(ScheduleError::Warps { warps: s.warps });
    }
    if s.ctas_per_sm == 0 || s.ctas_per_sm * 32 * s.warps > 2048 {
        return Err(ScheduleError::Ctas { ctas: s.ctas_per_sm, threads: 32 * s.warps });
    }
    if !(2..=16).contains(&s.stages) {
        return Err(ScheduleError::Stages { stages: s.stages });
    }
    let total = decode_smem(spec, tiers, d, gqa, s).total;
    if total > MAX_SMEM_PER_CTA {
        return Err(ScheduleError::Smem { bytes: total });
    }
    Ok(())
}

/// A small table of schedules of one decode format, for tests that run a format under each:
/// the default, the other warp count, fp32 values, the shallowest pipeline and one CTA per SM,
/// less those that [`check`] refuses and duplicates; the default first.
pub fn alternatives(spec: &Spec, tiers: &[TierId], d: usize, gqa: usize) -> Vec<Schedule> {
    let def = choose(spec, tiers, d, gqa);
    let other = if def.warps == 4 { 8 } else { 4 };
    let cands = [
        def,
        choose_entry(spec, tiers, d, gqa, other, Entry::Decode),
        Schedule { tc_values: !def.tc_values, ..def },
        Schedule { stages: 2, ..def },
        Schedule { ctas_per_sm: 1, ..def },
        Schedule { stages: 2, ctas_per_sm: 1, tc_values: !def.tc_values, ..def },
    ];
    let mut out: Vec<Schedule> = Vec::new();
    for c in cands {
        if !out.contains(&c) && check(spec, tiers, d, gqa, &c).is_ok() {
            out.push(c);
        }
    }
    out
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
/// and each page one long latency chain. The largest power of two
/// whose slices (P·D / split floats) still give every thread [`TRANSCODE_FLOATS_PER_THREAD`]
/// floats, and cut whole tokens (P % split) and, for per-channel destination keys, whole
/// 8-channel chunks (D % 8·split).
pub fn transcode_split(spec: &Spec, dst: &Tier, d: usize) -> usize {
    let p = spec.page.tokens;
    let slice = TRANSCODE_FLOATS_PER_THREAD * threads(spec);
    let fits = |s: usize| p.is_multiple_of(s) && (!slices_channels(dst) || d.is_multiple_of(8 * s));
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

/// Shared-memory plan of a transcode CTA (`Cfg::SMEM_*`): one slice of P·D / split floats,
/// then the destination key codec's scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TranscodeSmem {
    pub x: usize,
    pub scratch: usize,
    pub total: usize,
}

pub fn transcode_smem(spec: &Spec, dst: &Tier, d: usize) -> TranscodeSmem {
    let scratch = align16(spec.page.tokens * d / transcode_split(spec, dst, d) * 4);
    TranscodeSmem { x: 0, scratch, total: scratch + align16(transcode_scratch(spec, dst, d)) }
}
