//! ParisKV retrieval decode on the device (seed 001 §4; f64 reference: kvforge-paris).
//!
//! A [`ParisIndex`] holds, for `batch` sequences × `kv_heads`, the retrieval region of each
//! sequence: its per-key summaries on the GPU and its fp16 K/V in pinned host memory, read by
//! the kernels over UVA; and the dense rows each sequence keeps on the GPU (sinks, local
//! window, update buffer), set with [`ParisIndex::set_dense`]. A decode step is
//! [`ParisIndex::retrieve`] (bonus + vote, top-C select, rerank, top-k) then
//! [`ParisIndex::attend`] (fetch + attention over dense and retrieved rows, one softmax);
//! [`ParisIndex::step_timed`] runs both and splits the device time.
//!
//! GQA: by default the `gqa` query heads of a kv head share one retrieval — one vote, top-`C`,
//! rerank, top-`k` and one fetch of the rows from host memory — for the sum of their queries
//! (`kvforge_paris::group_query`: the group's summed logits); each head then attends its own
//! softmax over those rows. [`ParisGeometry::per_query_head`] retrieves for every query head
//! instead (`gqa`× the vote / rerank / top-`k` work and host reads).
//!
//! The shared retrieval's rerank ranks the candidates by [`ParisGeometry::rank`]: by default
//! [`Rank::GroupMax`] ("hmax"), the largest of the `gqa` heads' own eq. 10 estimates (the
//! `rerank_hmax` kernel reads and unpacks a candidate's codes once for all heads; up to 8 heads
//! per kv head), or [`Rank::Summed`], the summed query's estimate. The vote, top-`C`, top-`k`,
//! fetch and attention are the same in both (kvforge-paris `Rank` says why max is the default).
//!
//! ```ignore
//! let dev = Device::open(0)?;
//! let geo = ParisGeometry { batch: 1, kv_heads: 8, gqa: 4, per_query_head: false, rank: Rank::GroupMax, layout: SummaryLayout::Whole64, capacity: 1 << 20, dense_capacity: 1024, max_candidates: 65536, max_k: 256, host_budget_bytes: 40 << 30 };
//! let mut ix = ParisIndex::new(&dev, ParisConfig::default_for(128), geo)?;
//! ix.append(0, &keys, &values)?;          // [rows][Hkv][D] fp16 each
//! ix.set_dense(0, &dense_k, &dense_v)?;   // sinks + local
//! let top = ix.retrieve(&q, 100, &ix.default_schedule())?;
//! let (out, lse) = ix.attend(&q, true)?;
//! ```
//!
//! Summaries: [`ParisGeometry::layout`] picks the seed's per-subspace summaries
//! ([`SummaryLayout::Subspace4`], 112 B per key and kv head at head dim 128) or the
//! whole-vector code of `D/2` bytes ([`SummaryLayout::Whole64`], the default where the head dim
//! allows, [`SummaryLayout::for_config`]; 64 B: ids = the codes' sign plane, the vote unchanged; `encode_whole` / `rerank_whole*` in paris.cuh; its weight grid is
//! fixed per (sequence, kv head) by the first append holding a key of positive weight for the
//! kv head, normally the prefill). Its default schedule is
//! [`ParisIndex::default_schedule`] (ρ 0.30 from 64K keys).
//!
//! On its own the index is a store: the sliding-window update that moves rows from the local
//! window into it is the caller's, through [`ParisIndex::append`], and its dense rows are fp16.
//! [`crate::retrieval::RetrievalCache`] puts it beside a [`crate::KvCache`] instead: the cache
//! holds sinks and window in any tier, moves pages into the index as the window fills, and
//! [`ParisIndex::step_merged`] folds the cache's decode into the step.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUfunction_attribute};
use cudarc::driver::{CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg};
use half::f16;
use kvforge_paris::{CompactSummaries, LogGrid, ParisConfig, Rank, Schedule, SummaryLayout};

use crate::device::Device;
use crate::error::{drv, Result, RtError};
use crate::host_slab::HostSlab;

/// Sizes of an index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ParisGeometry {
    pub batch: usize,
    pub kv_heads: usize,
    /// Query heads per kv head.
    pub gqa: usize,
    /// One retrieval per query head instead of one per kv head for its group's summed query
    /// (module docs).
    pub per_query_head: bool,
    /// How the rerank of a kv head's shared retrieval ranks its candidates: the summed query's
    /// estimate, or the largest of the group's heads' estimates (module docs). No effect per
    /// query head or at `gqa` 1, where both are the one head's estimate.
    pub rank: Rank,
    /// The summaries the GPU keeps per key (module docs): the whole-vector code of `D/2` bytes
    /// (the default) or the seed's 112 B.
    pub layout: SummaryLayout,
    /// Retrieval-region keys per sequence (pinned host K/V and GPU summaries are sized for it).
    pub capacity: usize,
    /// Dense rows per (sequence, kv head) on the GPU.
    pub dense_capacity: usize,
    /// Most vote candidates per retrieval (sequence and kv head, or query head).
    pub max_candidates: usize,
    /// Most retrieved keys per retrieval, at most 1024.
    pub max_k: usize,
    /// Pinned host bytes the index may take (K and V of the retrieval region).
    pub host_budget_bytes: usize,
}

impl ParisGeometry {
    /// Pinned host bytes of the retrieval-region K/V.
    pub fn host_bytes(&self, d: usize) -> usize {
        2 * self.batch * self.kv_heads * self.capacity * d * 2
    }

    /// Retrievals per kv head: 1, or `gqa` with [`ParisGeometry::per_query_head`].
    pub fn rows_per_kv_head(&self) -> usize {
        if self.per_query_head {
            self.gqa
        } else {
            1
        }
    }

    /// Retrievals per sequence (`kv_heads` × [`ParisGeometry::rows_per_kv_head`]).
    pub fn rows_per_sequence(&self) -> usize {
        self.kv_heads * self.rows_per_kv_head()
    }

    /// Whether the rerank scores each candidate for every head of the group (`rerank_hmax`):
    /// [`Rank::GroupMax`] with one retrieval per kv head of more than one query head.
    pub fn ranks_by_group_max(&self) -> bool {
        self.rank == Rank::GroupMax && !self.per_query_head && self.gqa > 1
    }
}

/// Most query heads per kv head that `rerank_hmax` serves (its lookup entries hold at most four
/// fp16 pairs, `hmax_pairs` in paris.cuh).
pub const HMAX_MAX_GQA: usize = 8;

/// fp16 pairs per (channel, code) entry of `rerank_hmax`'s lookup table for `gqa` heads: 1, 2
/// or 4 (one 4-, 8- or 16-byte shared load), as `hmax_pairs` in paris.cuh.
fn hmax_pairs(gqa: usize) -> usize {
    match gqa {
        0..=2 => 1,
        3..=4 => 2,
        _ => 4,
    }
}

/// Dynamic shared memory of `rerank_hmax`: the `[D][16]` entries of [`hmax_pairs`] half2.
fn hmax_lut_bytes(d: usize, gqa: usize) -> usize {
    d * 16 * hmax_pairs(gqa) * 4 + HMAX_ALIGN
}

/// Alignment of `rerank_hmax`'s table in its dynamic shared memory (`HMAX_ALIGN` in
/// paris.cuh): the kernel starts the table at the first multiple inside, so it asks for this
/// much more.
const HMAX_ALIGN: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct IndexRaw {
    ids: u64,
    codes: u64,
    weights: u64,
    hist: u64,
    len: u64,
    cap: i32,
    hkv: i32,
    wtop: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct EncodeParams {
    ix: IndexRaw,
    keys: u64,
    seq_of: u64,
    pos_of: u64,
    rows: i32,
    seed: u32,
    levels: [f32; 16],
    low: [f32; 8],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BonusParams {
    q: u64,
    hist: u64,
    target: u64,
    qrot: u64,
    qnorm: u64,
    bonus: u64,
    score_hist: u64,
    est_hist: u64,
    nr: i32,
    rg: i32,
    share: i32,
    hkv: i32,
    seed: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct VoteParams {
    ids: u64,
    len: u64,
    bonus: u64,
    scores: u64,
    score_hist: u64,
    cap: i32,
    hkv: i32,
    sstride: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BucketParams {
    scores: u64,
    hist: u64,
    n: u64,
    want: u64,
    chunk_gt: u64,
    chunk_eq: u64,
    out: u64,
    out_count: u64,
    cap: i32,
    stride: i32,
    nr: i32,
    chunks: i32,
}

/// Keys per CTA of the bucket top-C (`BUCKET_PER_THREAD` × 256 threads in paris.cuh).
const BUCKET_CHUNK: usize = 16 * 256;
/// Keys per CTA of its wide form (`BUCKET_PER_THREAD_WIDE` × 256).
const BUCKET_CHUNK_WIDE: usize = 64 * 256;
/// CTAs per SM from which the bucket top-C takes its wide form: on the H200 at batch 1 the wide
/// form took the top-C + top-k phases from 62.5 to 55.0 µs at 1M keys (512 CTAs instead of
/// 2048) but from 29.0 to 32.0 µs at 128K (64 CTAs instead of 256)
/// (`paris-bench-bucket-wide-h200-2026-11-29.json`).
const BUCKET_WIDE_CTAS_PER_SM: usize = 2;
/// Keys per CTA of the vote (`VOTE_CHUNK` in paris.cuh).
const VOTE_CHUNK: usize = 4096;
/// Bins of the rerank estimates' histogram per retrieval row (`EST_BINS` in paris.cuh).
const EST_BINS: usize = 1 << 14;
/// Keys of the top-k's threshold bin it resolves in one pass (`TIE_CAP` in paris.cuh).
const TIE_CAP: usize = 4096;
/// Estimates per CTA of the split top-k (`TOPK_CHUNK` in paris.cuh).
const TOPK_CHUNK: usize = 8 * 256;
/// Top-C sizes from which the split top-k is the default for launches with fewer rows than
/// SMs. Its two launches cost a few µs whatever the size: on the H200 at batch 1 it took the
/// top-k phases from 68.6 to 63.5 µs at 1M keys (52429 candidates) but from 29.2 to 32.8 µs at
/// 128K (13108), where one CTA per row does its few tiles sooner
/// (`paris-bench-split-topk-h200-2026-11-29.json`).
const SPLIT_MIN_CANDIDATES: usize = 8 * TOPK_CHUNK;
/// Most candidates per CTA of the rerank (`RERANK_CHUNK` in paris.cuh).
const RERANK_CHUNK: usize = 2048;
/// Candidates per thread-block iteration of the rerank (`RERANK_UNROLL` × 256 threads): the
/// granule of its chunk.
const RERANK_STEP: usize = 512;
/// CTAs per SM the rerank's grid should reach before its chunk stops shrinking. Each CTA
/// rotates its queries and builds its lookup table first, so more CTAs are not free: on the
/// H200 at 1M keys × batch 1, 103 CTAs a row (chunk 512) took 66 µs against 51 for 26 (2048),
/// while at 128K × 1 26 CTAs a row (512) took 20 µs against 32 for 7 (2048).
const RERANK_CTAS_PER_SM: usize = 2;

/// Whether a top-k launch of `rows` retrieval rows, the largest top-C `most`, on `sms` SMs takes
/// the split form by default: rows that leave SMs idle, and a top-C long enough to pay for the
/// second launch ([`SPLIT_MIN_CANDIDATES`]).
fn split_topk_by_default(rows: usize, most: usize, sms: usize) -> bool {
    rows < sms && most >= SPLIT_MIN_CANDIDATES
}

/// Whether a bucket top-C launch of `rows` retrieval rows of up to `most` keys on `sms` SMs takes
/// the wide form by default: where its grid still gives every SM [`BUCKET_WIDE_CTAS_PER_SM`]
/// CTAs.
fn wide_bucket_by_default(rows: usize, most: usize, sms: usize) -> bool {
    most.div_ceil(BUCKET_CHUNK_WIDE) * rows >= BUCKET_WIDE_CTAS_PER_SM * sms
}

/// Candidates per CTA of the rerank for `rows` retrieval rows of up to `cmax` candidates on
/// `sms` SMs: [`RERANK_CHUNK`] where the rows fill the GPU, smaller (down to one block
/// iteration) where few short rows would leave SMs idle, as at 128K × batch 1, whose CTAs
/// otherwise wait on their scattered code reads with a CTA on one SM in three.
fn rerank_chunk(cmax: usize, rows: usize, sms: usize) -> usize {
    let even = (cmax * rows).div_ceil(sms.max(1) * RERANK_CTAS_PER_SM);
    even.next_multiple_of(RERANK_STEP).clamp(RERANK_STEP, RERANK_CHUNK)
}
/// 16-byte loads per thread of the fetch (`FETCH_UNROLL` in paris.cuh).
const FETCH_UNROLL: usize = 8;
/// Threads per CTA of the fetch (the entry's launch bounds).
const FETCH_THREADS: usize = 128;
/// 16-byte host reads the fetch keeps in flight (128 KiB), which sets its grid: CTAs stride over
/// the retrieval rows in order, so the reads in flight cover a few rows' host regions at a time.
/// The device caches the translations of a few hundred MiB of host memory; reads spread over
/// the whole slab (tens of GiB) miss them and run at under half the link's rate, whatever the
/// pages' size (`uva_read` with `--ctas`). About 128 KiB in flight still covers the link's
/// latency, leaves the SMs to the retrieval kernels of the pipelined step, and a small fetch
/// keeps its spread over the SMs (smaller pieces per CTA, so more CTAs).
const FETCH_IN_FLIGHT: usize = 8 * FETCH_THREADS * FETCH_UNROLL;

/// 16-byte pieces per CTA of the fetch for `pieces` per retrieval row and `rows` rows: the most a
/// CTA takes (`FETCH_THREADS · FETCH_UNROLL`), or fewer, in whole CTAs of threads, where the
/// work would not give two CTAs per SM: at batch 1 the few rows' reads then spread over more
/// CTAs ([`fetch_grid`] keeps the same reads in flight either way).
fn fetch_per_cta(pieces: usize, rows: usize, sms: usize) -> usize {
    let most = FETCH_THREADS * FETCH_UNROLL;
    let spread = (pieces * rows).div_ceil(2 * sms.max(1)).next_multiple_of(FETCH_THREADS);
    spread.clamp(FETCH_THREADS, most)
}

/// The fetch's launch for `pieces` per retrieval row and `rows` rows on `sms` SMs: pieces per
/// CTA ([`fetch_per_cta`]) and CTAs, as many as keep [`FETCH_IN_FLIGHT`] reads in flight (or
/// `cap`, where set), never more than the work items.
fn fetch_grid(pieces: usize, rows: usize, sms: usize, cap: Option<usize>) -> (usize, usize) {
    let per_cta = fetch_per_cta(pieces, rows, sms);
    let items = rows * pieces.div_ceil(per_cta);
    (per_cta, items.min(cap.unwrap_or(FETCH_IN_FLIGHT / per_cta)))
}

/// Score row stride: the capacity rounded up to 16 keys (the bucket kernels read 16 scores with
/// one load, the vote writes 4 with one store).
fn score_stride(capacity: usize) -> usize {
    capacity.div_ceil(16) * 16
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct TopkSplitParams {
    est: u64,
    cand: u64,
    count: u64,
    want: u64,
    est_hist: u64,
    chunk_gt: u64,
    chunk_eq: u64,
    thresh: u64,
    done: u64,
    tie_key: u64,
    tie_pos: u64,
    out: u64,
    out_count: u64,
    cmax: i32,
    stride: i32,
    nr: i32,
    chunks: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SelectParams {
    scores: u64,
    est: u64,
    cand: u64,
    n: u64,
    count: u64,
    want: u64,
    out: u64,
    out_count: u64,
    est_hist: u64,
    cap: i32,
    cmax: i32,
    stride: i32,
    nr: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RerankParams {
    ix: IndexRaw,
    qrot: u64,
    qnorm: u64,
    cand: u64,
    count: u64,
    est: u64,
    est_hist: u64,
    q: u64,
    cmax: i32,
    nr: i32,
    rg: i32,
    chunk: i32,
    seed: u32,
    levels: [f32; 16],
    low: [f32; 8],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FetchParams {
    host_k: u64,
    host_v: u64,
    top: u64,
    top_count: u64,
    k_out: u64,
    v_out: u64,
    error_flags: u64,
    len: u64,
    host_cap: i32,
    kmax: i32,
    nr: i32,
    rg: i32,
    hkv: i32,
    host_stride: i32,
    per_cta: i32,
    rows: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttendParams {
    q: u64,
    dense_k: u64,
    dense_v: u64,
    dense_len: u64,
    k_rows: u64,
    v_rows: u64,
    host_k: u64,
    host_v: u64,
    top: u64,
    top_count: u64,
    out: u64,
    lse: u64,
    scale: f32,
    dense_cap: i32,
    host_cap: i32,
    kmax: i32,
    hq: i32,
    hkv: i32,
    share: i32,
    host_stride: i32,
    merge_out: u64,
    merge_lse: u64,
    merge_bf16: i32,
}

/// A softmax block over other keys of the same queries, on the device: what
/// [`ParisIndex::step_merged`] folds into the step's output (`kvforge_rt::retrieval`: the main
/// cache's decode of the GPU region).
#[derive(Debug)]
pub struct DenseBlock {
    /// `[batch][Hq][D]` in the spec dtype: fp16, or bf16 where `bf16`.
    pub out: u64,
    /// `[batch][Hq]` f32, natural log.
    pub lse: u64,
    pub bf16: bool,
    /// Recorded on the stream that computes the block, after its last kernel: the attention
    /// that folds the block in waits for it.
    pub ready: CudaEvent,
}

// The C++ structs of kvforge/paris.cuh, field for field.
const _: () = assert!(std::mem::size_of::<IndexRaw>() == 56);
const _: () = assert!(std::mem::size_of::<EncodeParams>() == 184);
const _: () = assert!(std::mem::size_of::<BonusParams>() == 88);
const _: () = assert!(std::mem::size_of::<VoteParams>() == 56);
const _: () = assert!(std::mem::size_of::<BucketParams>() == 80);
const _: () = assert!(std::mem::size_of::<SelectParams>() == 88);
const _: () = assert!(std::mem::size_of::<TopkSplitParams>() == 120);
const _: () = assert!(std::mem::size_of::<RerankParams>() == 232);
const _: () = assert!(std::mem::size_of::<FetchParams>() == 96);
const _: () = assert!(std::mem::size_of::<AttendParams>() == 152);

// SAFETY: plain-old-data mirrors of the kernel parameter structs (asserted sizes above).
unsafe impl DeviceRepr for EncodeParams {}
unsafe impl DeviceRepr for BonusParams {}
unsafe impl DeviceRepr for VoteParams {}
unsafe impl DeviceRepr for SelectParams {}
unsafe impl DeviceRepr for TopkSplitParams {}
unsafe impl DeviceRepr for BucketParams {}
unsafe impl DeviceRepr for RerankParams {}
unsafe impl DeviceRepr for FetchParams {}
unsafe impl DeviceRepr for AttendParams {}

/// Device time of one decode step's phases, microseconds (CUDA events).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct StepTimes {
    /// Bonus tables and collision vote.
    pub vote_us: f64,
    /// Top-C select of the vote scores and top-k of the rerank estimates.
    pub topk_us: f64,
    pub rerank_us: f64,
    /// Gather of the k retrieved K/V rows from pinned host memory.
    pub fetch_us: f64,
    pub attend_us: f64,
    /// The alternative to fetch + attend: attention reading the retrieved rows from pinned host
    /// memory itself (`attend_fused`), timed after the step (not part of it).
    pub attend_fused_us: f64,
}

/// Sequences `[s0, s0 + n)` of the batch: what one launch covers. Every device buffer is
/// sequence-major (`[S][...]`), so a span's launch passes each pointer advanced by `s0`
/// sequences and sizes its grid for `n`: no kernel knows about spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    s0: usize,
    n: usize,
}

/// Splits `batch` sequences into `chunks` spans of near-equal size (at most `batch` of them).
fn spans(batch: usize, chunks: usize) -> Vec<Span> {
    let chunks = chunks.clamp(1, batch.max(1));
    (0..chunks).map(|c| Span { s0: c * batch / chunks, n: (c + 1) * batch / chunks - c * batch / chunks }).filter(|s| s.n > 0).collect()
}

/// The retrieval index of a batch (module docs).
pub struct ParisIndex {
    st: Arc<CudaStream>,
    /// The pipelined step's second stream: fetch + attend of one span while `st` retrieves the
    /// next (host-link reads beside HBM-bound kernels). Higher priority, so that its CTAs take
    /// SM slots ahead of the queued retrieval CTAs.
    fetch_st: Arc<CudaStream>,
    ctx: Arc<cudarc::driver::CudaContext>,
    cfg: ParisConfig,
    geo: ParisGeometry,
    funcs: HashMap<&'static str, CudaFunction>,
    /// The direction levels: `levels(m, 4)`, or `levels(D, 4)` for Whole64.
    levels: [f32; 16],
    /// Whole64: `levels(D, 3)` of the low coordinates (zero otherwise).
    low: [f32; 8],
    /// Opt-in shared memory per CTA: top-k stages the estimates there when they fit.
    max_smem: usize,
    /// Top-k by the radix select over the estimates instead of the one-pass histogram top-k.
    radix_topk: bool,
    /// The one-pass top-k over many CTAs per row: `None` where a launch has fewer retrieval
    /// rows than SMs (and the scratch holds them), or as set (`set_split_topk`).
    split_topk: Option<bool>,
    /// The bucket top-C's wide form (64 keys a thread): `None` where its grid still gives
    /// every SM `BUCKET_WIDE_CTAS_PER_SM` CTAs, or as set (`set_wide_bucket`).
    wide_bucket: Option<bool>,
    /// Each sequence's top-C size of the last `prepare` (the split top-k's grid).
    plan_candidates: Vec<usize>,
    /// CTAs of the fetch's grid-stride grid, where set (`set_fetch_ctas`).
    fetch_ctas: Option<usize>,
    ids: CudaSlice<u8>,
    /// `[S][Hkv][cap][D/2]` 4-bit codes, or Whole64's `[S][Hkv][cap][3D/8]` rows.
    codes: CudaSlice<u8>,
    /// `[S][Hkv][cap][B]` fp16 (unused with Whole64).
    weights: CudaSlice<u16>,
    hist: CudaSlice<u32>,
    /// Whole64: `[S][Hkv]` the weight grid's top code (`i32::MIN`: none yet).
    wtop: CudaSlice<i32>,
    /// `wtop` as the host last wrote it (only `append` writes it).
    wtop_host: Vec<i32>,
    len_d: CudaSlice<u32>,
    len: Vec<usize>,
    /// Retrieval-region K/V, `[S][Hkv][capacity][K | V]` fp16: a token's rows side by side
    /// (one run of `4 D` bytes, one host page), read over UVA by the fetch and the fused attend.
    host_kv: HostSlab,
    host_k_ptr: u64,
    host_v_ptr: u64,
    dense_k: CudaSlice<u16>,
    dense_v: CudaSlice<u16>,
    dense_len_d: CudaSlice<u32>,
    dense_len: Vec<usize>,
    ws: Workspace,
    /// SMs of the device (the fetch's grid).
    sms: usize,
}

/// Per-step buffers.
struct Workspace {
    /// A step's inputs, one upload: queries `[batch][Hq][D]` fp16 (two to a word), then the
    /// plan's vote targets, candidate counts and top-k counts, `[batch]` each ([`Inputs`]).
    inputs: CudaSlice<u32>,
    /// Their pinned staging copy (written by the host once the last upload from it has run).
    staging: PinnedHostSlice<u32>,
    /// Recorded behind each upload from `staging`. The device's context does not track events
    /// (`Device::open`), so the pinned slice's own event is never recorded: the host waits on
    /// this one before writing the staging copy again.
    staged: CudaEvent,
    qrot: CudaSlice<f32>,
    qnorm: CudaSlice<f32>,
    bonus: CudaSlice<u8>,
    scores: CudaSlice<u8>,
    score_hist: CudaSlice<u32>,
    est_hist: CudaSlice<u32>,
    chunk_gt: CudaSlice<u32>,
    chunk_eq: CudaSlice<u32>,
    /// Scratch of the split top-k for [`Workspace::split_rows`] retrieval rows.
    split: SplitScratch,
    cand: CudaSlice<u32>,
    cand_count: CudaSlice<u32>,
    est: CudaSlice<f32>,
    top: CudaSlice<u32>,
    top_count: CudaSlice<u32>,
    k_rows: CudaSlice<u16>,
    v_rows: CudaSlice<u16>,
    /// A step's results, one download: the attention's output `[batch][Hq][D]` and log-sum-exp
    /// `[batch][Hq]` (f32 bits), then the fetch's error flags (one word).
    result: CudaSlice<u32>,
    /// Their pinned landing copy, read once `landed` (recorded behind the download) has passed:
    /// the slice's own event is never recorded (event tracking is off, `Device::open`).
    result_host: PinnedHostSlice<u32>,
    landed: CudaEvent,
}

/// [`Workspace::inputs`]: the queries' words, then three `[batch]` arrays of the plan.
#[derive(Clone, Copy)]
enum Inputs {
    /// Vote targets ⌈ρ n⌉.
    Target = 0,
    /// Candidates of the top-C.
    Candidates = 1,
    /// Keys of the top-k.
    TopK = 2,
}

impl Inputs {
    /// Words of the inputs of `q_halves` query values over `batch` sequences.
    fn words(q_halves: usize, batch: usize) -> usize {
        q_halves.div_ceil(2) + 3 * batch
    }
}

impl Workspace {
    /// The staging copy, once the last upload from it has run (`staged`), with queries `q` in
    /// its first words, two fp16 to a word (the first in the low half, as the device reads
    /// `[batch][Hq][D]` fp16); the plan's words follow.
    fn stage_queries(&mut self, q: &[f16]) -> Result<&mut [u32]> {
        self.staged.synchronize().map_err(drv("query staging"))?;
        let host = self.staging.as_mut_slice().map_err(drv("query staging"))?;
        for (w, pair) in host.iter_mut().zip(q.chunks(2)) {
            *w = u32::from(pair[0].to_bits()) | pair.get(1).map_or(0, |h| u32::from(h.to_bits()) << 16);
        }
        Ok(host)
    }

    /// Uploads the staging copy into `inputs` on `st`, with `staged` recorded behind it.
    fn upload_inputs(&mut self, st: &Arc<CudaStream>) -> Result<()> {
        st.memcpy_htod(&self.staging, &mut self.inputs).map_err(drv("queries and plan"))?;
        self.staged.record(st).map_err(drv("staging event"))
    }
}

/// The split top-k's scratch (paris.cuh `TopkSplitParams`), for `rows` retrieval rows of one
/// launch: the spans of a step launch on one stream, one after the other, so they share it.
struct SplitScratch {
    rows: usize,
    chunks: usize,
    chunk_gt: CudaSlice<u32>,
    chunk_eq: CudaSlice<u32>,
    thresh: CudaSlice<u32>,
    done: CudaSlice<u32>,
    tie_key: CudaSlice<u32>,
    tie_pos: CudaSlice<u32>,
}

fn bits(x: &[f16]) -> &[u16] {
    // SAFETY: f16 is a transparent u16.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u16>(), x.len()) }
}

impl ParisIndex {
    /// Compiles the module (NVRTC, once per index) and allocates everything: summaries and
    /// workspace on the GPU, the retrieval-region K/V in pinned host memory. A geometry over
    /// the host budget, or pinned memory that cannot be allocated, is a typed error with
    /// nothing left allocated.
    pub fn new(dev: &Device, cfg: ParisConfig, geo: ParisGeometry) -> Result<ParisIndex> {
        cfg.validate()?;
        geo.layout.validate(&cfg)?;
        let d = cfg.head_dim;
        if cfg.max_score() > 255 {
            return Err(RtError::BadInput(format!("ParisKV on the device keeps collision scores in a byte: subspaces × tiers = {} > 255", cfg.max_score())));
        }
        if geo.max_k == 0 || geo.max_k > 1024 || geo.max_k > geo.max_candidates || geo.batch == 0 || geo.kv_heads == 0 || geo.gqa == 0 || geo.capacity == 0 {
            return Err(RtError::BadInput(format!("ParisKV geometry {geo:?}: needs 0 < max_k ≤ min(1024, max_candidates) and non-zero sizes")));
        }
        if geo.ranks_by_group_max() && geo.gqa > HMAX_MAX_GQA {
            return Err(RtError::BadInput(format!("ParisKV Rank::GroupMax serves up to {HMAX_MAX_GQA} query heads per kv head, got gqa {}: use Rank::Summed or per_query_head", geo.gqa)));
        }
        let need = geo.host_bytes(d);
        if need > geo.host_budget_bytes {
            return Err(RtError::HostBudget {
                what: format!("ParisKV retrieval-region K/V ({} keys × {} sequences × {} kv heads, head dim {d})", geo.capacity, geo.batch, geo.kv_heads),
                need,
                budget: geo.host_budget_bytes,
            });
        }
        let st = dev.stream.clone();
        let ctx = dev.ctx.clone();
        let (m, b, c) = (cfg.m(), cfg.subspaces, cfg.centroids());
        let symbol = kvforge_gen::paris_symbol(d, m, cfg.tiers, geo.gqa);
        let source = kvforge_gen::render_paris(d, m, cfg.tiers, geo.gqa).map_err(|e| RtError::BadInput(e.to_string()))?;
        let compiled = crate::jit::compile_module(&symbol, &source, &dev.info.arch(), false)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin)).map_err(drv(format!("loading {symbol}")))?;
        let mut funcs = HashMap::new();
        for e in kvforge_gen::PARIS_ENTRIES {
            funcs.insert(*e, module.load_function(&format!("{symbol}_{e}")).map_err(drv(format!("symbol {symbol}_{e}")))?);
        }
        let (mut levels, mut low) = ([0f32; 16], [0f32; 8]);
        match geo.layout {
            SummaryLayout::Subspace4 => levels.copy_from_slice(&cfg.levels().levels_f32),
            SummaryLayout::Whole64 => {
                use kvforge_spec::codecs::rotated::levels::levels as table;
                levels.copy_from_slice(&table(d, 4).levels_f32);
                low.copy_from_slice(&table(d, 3).levels_f32);
            }
        }
        // Huge pages where the host grants them: the fetch's scattered row reads are bound by
        // host page translations on 4 KiB pages (docs/paris.md). Zeroed; a row is written by
        // `append` before `len` admits it, and kernels read only rows below `len`.
        let host_kv = HostSlab::new(&ctx, need, "ParisKV retrieval-region keys and values")?;
        // Keys at the start of each token's 2 D halves, values D halves on (`host_stride` 2 D).
        let host_k_ptr = host_kv.device_ptr()?;
        let host_v_ptr = host_k_ptr + (d * 2) as u64;
        let heads = geo.batch * geo.kv_heads;
        let qh = heads * geo.gqa;
        // Retrieval rows.
        let nr = geo.batch * geo.rows_per_sequence();
        let z8 = |n: usize, what: &str| st.alloc_zeros::<u8>(n.max(1)).map_err(drv(what.to_string()));
        let z16 = |n: usize, what: &str| st.alloc_zeros::<u16>(n.max(1)).map_err(drv(what.to_string()));
        let z32 = |n: usize, what: &str| st.alloc_zeros::<u32>(n.max(1)).map_err(drv(what.to_string()));
        let zf = |n: usize, what: &str| st.alloc_zeros::<f32>(n.max(1)).map_err(drv(what.to_string()));
        let ws = Workspace {
            inputs: z32(Inputs::words(qh * d, geo.batch), "queries and plan")?,
            // SAFETY: every word is written by `prepare` before the one upload from it.
            staging: unsafe { ctx.alloc_pinned::<u32>(Inputs::words(qh * d, geo.batch)) }.map_err(drv("pinned staging of the queries and plan"))?,
            staged: ctx.new_event(None).map_err(drv("staging event"))?,
            qrot: zf(nr * d, "rotated queries")?,
            qnorm: zf(nr, "query norms")?,
            // Packed 4 retrieval rows to a 32-bit word per (kv head, subspace, centroid).
            bonus: z8(heads * geo.rows_per_kv_head().div_ceil(4) * 4 * b * c, "bonus tables")?,
            scores: z8(nr * score_stride(geo.capacity), "collision scores")?,
            score_hist: z32(nr * 256, "score histograms")?,
            est_hist: z32(nr * EST_BINS, "estimate histograms")?,
            chunk_gt: z32(nr * geo.capacity.div_ceil(BUCKET_CHUNK), "bucket counts")?,
            chunk_eq: z32(nr * geo.capacity.div_ceil(BUCKET_CHUNK), "bucket counts")?,
            split: {
                let (rows, chunks) = (nr.min(dev.info.sm_count.max(1)), geo.max_candidates.div_ceil(TOPK_CHUNK));
                SplitScratch {
                    rows,
                    chunks,
                    chunk_gt: z32(rows * chunks, "top-k chunk counts")?,
                    chunk_eq: z32(rows * chunks, "top-k chunk counts")?,
                    thresh: z32(rows * 2, "top-k thresholds")?,
                    done: z32(rows, "top-k counters")?,
                    tie_key: z32(rows * TIE_CAP, "top-k ties")?,
                    tie_pos: z32(rows * TIE_CAP, "top-k ties")?,
                }
            },
            cand: z32(nr * geo.max_candidates, "candidates")?,
            cand_count: z32(nr, "candidate counts")?,
            est: zf(nr * geo.max_candidates, "rerank estimates")?,
            top: z32(nr * geo.max_k, "top-k")?,
            top_count: z32(nr, "top-k counts")?,
            k_rows: z16(nr * geo.max_k * d, "fetched keys")?,
            v_rows: z16(nr * geo.max_k * d, "fetched values")?,
            result: z32(qh * d + qh + 1, "output, lse and error flags")?,
            // SAFETY: read only after a download into it has landed (`finish`).
            result_host: unsafe { ctx.alloc_pinned_with_flags::<u32>(qh * d + qh + 1, 0) }.map_err(drv("pinned landing of the output"))?,
            landed: ctx.new_event(None).map_err(drv("output event"))?,
        };
        let (_, greatest) = cudarc::driver::result::stream::get_priority_range().map_err(drv("stream priorities"))?;
        let fetch_st = ctx.new_stream_with_priority(greatest).map_err(drv("ParisKV fetch stream"))?;
        Ok(ParisIndex {
            fetch_st,
            ids: z8(heads * geo.capacity * b, "centroid ids")?,
            codes: z8(heads * geo.capacity * Self::code_bytes(&cfg, geo.layout), "direction codes")?,
            weights: z16(if geo.layout == SummaryLayout::Whole64 { 0 } else { heads * geo.capacity * b }, "weights")?,
            hist: z32(heads * b * c, "occupancy")?,
            wtop: st.clone_htod(&vec![i32::MIN; heads]).map_err(drv("weight grids"))?,
            wtop_host: vec![i32::MIN; heads],
            len_d: z32(geo.batch, "lengths")?,
            len: vec![0; geo.batch],
            dense_k: z16(heads * geo.dense_capacity * d, "dense keys")?,
            dense_v: z16(heads * geo.dense_capacity * d, "dense values")?,
            dense_len_d: z32(geo.batch, "dense lengths")?,
            dense_len: vec![0; geo.batch],
            st,
            ctx,
            cfg,
            geo,
            funcs,
            levels,
            low,
            max_smem: dev.info.max_smem_per_block,
            sms: dev.info.sm_count,
            radix_topk: false,
            split_topk: None,
            wide_bucket: None,
            plan_candidates: vec![0; geo.batch],
            fetch_ctas: None,
            host_kv,
            host_k_ptr,
            host_v_ptr,
            ws,
        })
    }

    /// Selects the top-k of the rerank estimates by the radix select (four passes over them)
    /// instead of the default one-pass top-k over the rerank's histogram; both keep the same set
    /// (ties in index order). For comparisons and as a fallback.
    pub fn set_radix_topk(&mut self, on: bool) {
        self.radix_topk = on;
    }

    /// Splits the one-pass top-k over many CTAs per retrieval row (`Some(true)`), keeps one CTA
    /// per row (`Some(false)`), or splits launches with fewer rows than SMs and a large top-C
    /// (`None`, the default: at batch 1 × 1M keys one CTA per row leaves most SMs idle for
    /// tens of µs). Every path keeps the same set in the same order; launches with more rows
    /// than the scratch holds (the device's SM count) keep one CTA per row.
    pub fn set_split_topk(&mut self, split: Option<bool>) {
        self.split_topk = split;
    }

    /// Runs the bucket top-C with 64 keys a thread (`Some(true)`), 16 (`Some(false)`), or the
    /// wide form where its grid still fills the SMs (`None`, the default). Both keep the same
    /// candidates in the same order.
    pub fn set_wide_bucket(&mut self, wide: Option<bool>) {
        self.wide_bucket = wide;
    }

    /// Caps the fetch's grid at `ctas` CTAs (`None`: the default cap). The CTAs stride over the
    /// retrieval rows in order, so the cap bounds the host reads in flight and the span of
    /// host addresses they touch at once. For tuning and comparisons.
    pub fn set_fetch_ctas(&mut self, ctas: Option<usize>) {
        self.fetch_ctas = ctas.map(|c| c.max(1));
    }

    pub fn config(&self) -> &ParisConfig {
        &self.cfg
    }

    pub fn geometry(&self) -> &ParisGeometry {
        &self.geo
    }

    /// Retrieval-region keys of sequence `seq`.
    pub fn len(&self, seq: usize) -> usize {
        self.len[seq]
    }

    pub fn is_empty(&self) -> bool {
        self.len.iter().all(|&n| n == 0)
    }

    /// GPU-resident bytes per retrieval-region key and kv head (the summaries).
    pub fn device_bytes_per_key(&self) -> usize {
        self.geo.layout.bytes_per_key(&self.cfg)
    }

    /// Bytes of the `codes` array per key: the 4-bit codes (`D/2`), or Whole64's row (`3D/8`).
    fn code_bytes(cfg: &ParisConfig, layout: SummaryLayout) -> usize {
        match layout {
            SummaryLayout::Subspace4 => cfg.head_dim / 2,
            SummaryLayout::Whole64 => 3 * cfg.head_dim / 8,
        }
    }

    /// The default schedule of the index's summary layout ([`SummaryLayout::schedule`]: for
    /// Whole64, ρ 0.30 from 64K keys).
    pub fn default_schedule(&self) -> Schedule {
        self.geo.layout.schedule()
    }

    /// GPU bytes the index holds for one sequence: summaries, occupancy, dense rows and the
    /// per-step workspace (scores, candidates, estimates, staged rows), for batch sizing.
    pub fn device_bytes_per_sequence(&self) -> usize {
        let (g, d) = (&self.geo, self.cfg.head_dim);
        let (b, c) = (self.cfg.subspaces, self.cfg.centroids());
        let (hq, nr) = (g.kv_heads * g.gqa, g.rows_per_sequence());
        let summaries = g.kv_heads * (g.capacity * self.device_bytes_per_key() + b * c * 4 + 4);
        let dense = 2 * g.kv_heads * g.dense_capacity * d * 2;
        let bonus = g.kv_heads * g.rows_per_kv_head().div_ceil(4) * 4 * b * c;
        let rows = nr * (score_stride(g.capacity) + 8 * g.max_candidates + g.max_k * (4 + 4 * d) + (256 + EST_BINS) * 4 + 2 * g.capacity.div_ceil(BUCKET_CHUNK) * 4 + d * 4 + 12);
        summaries + dense + bonus + rows + hq * (d * 6 + 4)
    }

    /// Every sequence of the batch.
    fn all(&self) -> Span {
        Span { s0: 0, n: self.geo.batch }
    }

    /// Device address of sequence `span.s0`'s queries (`[batch][Hq][D]` fp16 in the inputs).
    fn q_at(&self, span: Span) -> u64 {
        let per_seq = self.geo.kv_heads * self.geo.gqa * self.cfg.head_dim * 2;
        self.ws.inputs.device_ptr(&self.st).0 + (span.s0 * per_seq) as u64
    }

    /// Device address of sequence `span.s0`'s attention output (`[batch][Hq][D]` f32 in the
    /// results).
    fn out_at(&self, span: Span) -> u64 {
        let per_seq = self.geo.kv_heads * self.geo.gqa * self.cfg.head_dim * 4;
        self.ws.result.device_ptr(&self.st).0 + (span.s0 * per_seq) as u64
    }

    /// Device address of sequence `span.s0`'s log-sum-exps (`[batch][Hq]` f32, after the output).
    fn lse_at(&self, span: Span) -> u64 {
        let hq = self.geo.kv_heads * self.geo.gqa;
        self.ws.result.device_ptr(&self.st).0 + ((self.geo.batch * hq * self.cfg.head_dim + span.s0 * hq) * 4) as u64
    }

    /// Device address of the fetch's error flags (the results' last word).
    fn err_ptr(&self) -> u64 {
        let hq = self.geo.kv_heads * self.geo.gqa;
        self.ws.result.device_ptr(&self.st).0 + ((self.geo.batch * hq * (self.cfg.head_dim + 1)) * 4) as u64
    }

    /// Device address of sequence `span.s0`'s entry of the plan array `which`.
    fn plan_at(&self, which: Inputs, span: Span) -> u64 {
        let batch = self.geo.batch;
        let qw = (batch * self.geo.kv_heads * self.geo.gqa * self.cfg.head_dim).div_ceil(2);
        self.ws.inputs.device_ptr(&self.st).0 + ((qw + which as usize * batch + span.s0) * 4) as u64
    }

    /// Device address of sequence `span.s0`'s part of the sequence-major buffer `buf`.
    fn at<T>(&self, buf: &CudaSlice<T>, span: Span) -> u64 {
        let per_seq = buf.len() / self.geo.batch;
        buf.device_ptr(&self.st).0 + (span.s0 * per_seq * std::mem::size_of::<T>()) as u64
    }

    /// Bytes from the pinned slab's start to sequence `span.s0`'s K/V (`[S][Hkv][capacity][K | V]`).
    fn host_offset(&self, span: Span) -> u64 {
        (span.s0 * self.geo.kv_heads * self.geo.capacity * 2 * self.cfg.head_dim * 2) as u64
    }

    /// The largest top-C of the sequences of `span` under the last `prepare`'s plan.
    fn most_candidates(&self, span: Span) -> usize {
        self.plan_candidates[span.s0..span.s0 + span.n].iter().copied().max().unwrap_or(0)
    }

    /// The most keys any sequence of `span` holds (at least 1).
    fn most(&self, span: Span) -> usize {
        self.len[span.s0..span.s0 + span.n].iter().copied().max().unwrap_or(0).max(1)
    }

    fn raw(&self, span: Span) -> IndexRaw {
        IndexRaw {
            ids: self.at(&self.ids, span),
            codes: self.at(&self.codes, span),
            weights: self.at(&self.weights, span),
            hist: self.at(&self.hist, span),
            len: self.at(&self.len_d, span),
            cap: self.geo.capacity as i32,
            hkv: self.geo.kv_heads as i32,
            wtop: self.at(&self.wtop, span),
        }
    }

    fn check_seq(&self, seq: usize) -> Result<()> {
        if seq >= self.geo.batch {
            return Err(RtError::NoSequence(seq));
        }
        Ok(())
    }

    /// Launches the module's entry `entry` with its one parameter struct over `grid` CTAs of
    /// `block` threads and `smem` bytes of dynamic shared memory (opting in to more than the
    /// default where `smem` passes 40 KiB).
    ///
    /// # Safety
    /// `P` mirrors the entry's C++ parameter struct field for field (the sizes asserted at the
    /// top of this file), and every buffer it points to is sized for the launch: each caller
    /// states why.
    unsafe fn launch<P: DeviceRepr>(&self, entry: &str, params: &P, grid: (u32, u32, u32), block: u32, smem: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_on(&self.st, entry, params, grid, block, smem) }
    }

    /// [`ParisIndex::launch`] on stream `st`.
    ///
    /// # Safety
    /// As [`ParisIndex::launch`].
    unsafe fn launch_on<P: DeviceRepr>(&self, st: &CudaStream, entry: &str, params: &P, grid: (u32, u32, u32), block: u32, smem: usize) -> Result<()> {
        let f = &self.funcs[entry];
        if smem > 40 * 1024 {
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(drv(format!("paris {entry} shared memory")))?;
        }
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem as u32 };
        // SAFETY: the caller's contract above.
        unsafe { st.launch_builder(f).arg(params).launch(cfg) }.map_err(drv(format!("launch paris {entry}")))?;
        Ok(())
    }

    /// Appends `rows` keys and values (`[rows][kv_heads][D]` fp16 each) to the retrieval region
    /// of `seq`: K/V into pinned host memory, summaries encoded on the GPU. Past the capacity
    /// (the host budget) it is a typed error and nothing is written.
    pub fn append(&mut self, seq: usize, keys: &[f16], values: &[f16]) -> Result<()> {
        self.check_seq(seq)?;
        let (d, hkv) = (self.cfg.head_dim, self.geo.kv_heads);
        let row = hkv * d;
        if keys.len() != values.len() || !keys.len().is_multiple_of(row) {
            return Err(RtError::BadInput(format!("ParisKV append: keys ({}) and values ({}) must both be [rows][{hkv}][{d}]", keys.len(), values.len())));
        }
        if let Some(i) = keys.iter().chain(values).position(|v| !v.is_finite()) {
            return Err(RtError::BadInput(format!("ParisKV append: element {i} of the keys/values is not finite")));
        }
        let rows = keys.len() / row;
        let (start, end) = (self.len[seq], self.len[seq] + rows);
        if end > self.geo.capacity {
            return Err(RtError::HostBudget { what: format!("ParisKV sequence {seq} retrieval region ({start} + {rows} keys)"), need: end, budget: self.geo.capacity });
        }
        if rows == 0 {
            return Ok(());
        }
        // Host K/V: [S][Hkv][cap][K | V].
        let kp = self.host_kv.as_mut_ptr().cast::<u16>();
        for r in 0..rows {
            for h in 0..hkv {
                let dst = ((seq * hkv + h) * self.geo.capacity + start + r) * 2 * d;
                let src = (r * hkv + h) * d;
                // SAFETY: dst + 2 d ≤ batch × hkv × capacity × 2 d (end ≤ capacity), the slab's
                // length; no kernel reads rows at or past `len`, which is raised after.
                unsafe {
                    std::ptr::copy_nonoverlapping(bits(&keys[src..src + d]).as_ptr(), kp.add(dst), d);
                    std::ptr::copy_nonoverlapping(bits(&values[src..src + d]).as_ptr(), kp.add(dst + d), d);
                }
            }
        }
        let st = self.st.clone();
        let kd = st.clone_htod(bits(keys)).map_err(drv("new keys"))?;
        let seq_of = st.clone_htod(&vec![seq as u32; rows]).map_err(drv("new rows"))?;
        let pos_of = st.clone_htod(&(start as u32..end as u32).collect::<Vec<_>>()).map_err(drv("new rows"))?;
        let p = EncodeParams {
            ix: self.raw(self.all()),
            keys: kd.device_ptr(&st).0,
            seq_of: seq_of.device_ptr(&st).0,
            pos_of: pos_of.device_ptr(&st).0,
            rows: rows as i32,
            seed: self.cfg.seed,
            levels: self.levels,
            low: self.low,
        };
        let grid = (rows.div_ceil(4) as u32, hkv as u32, 1);
        if self.geo.layout == SummaryLayout::Whole64 {
            let tops = seq * hkv..(seq + 1) * hkv;
            if self.wtop_host[tops.clone()].contains(&i32::MIN) {
                // A kv head's weight grid is fixed by the first append that holds one of its
                // keys with a positive weight (the prefill; paris.cuh, "Whole64"): fit every kv
                // head of `seq` to this append's keys, keep the fit only where none was fixed
                // (an empty or all-zero earlier append leaves a head open), so no key already
                // coded changes grid.
                st.memcpy_htod(&vec![i32::MIN; hkv], &mut self.wtop.slice_mut(tops.clone())).map_err(drv("weight grids"))?;
                // SAFETY: EncodeParams; reads the rows of `keys` as the encode below and
                // writes only `wtop` of `seq`'s kv heads ([batch][kv_heads] i32).
                unsafe { self.launch("scale_whole", &p, grid, 128, 0) }?;
                let fitted = st.clone_dtoh(&self.wtop).map_err(drv("weight grids"))?;
                for i in tops.clone() {
                    if self.wtop_host[i] == i32::MIN {
                        self.wtop_host[i] = fitted[i];
                    }
                }
                st.memcpy_htod(&self.wtop_host[tops.clone()], &mut self.wtop.slice_mut(tops)).map_err(drv("weight grids"))?;
            }
            // SAFETY: EncodeParams; rows index `keys` ([rows][Hkv][D] uploaded above) and write
            // ids, rows ([cap][3D/8] per kv head) and occupancy at positions start..end <
            // capacity of `seq`.
            unsafe { self.launch("encode_whole", &p, grid, 128, 0) }?;
        } else {
            // SAFETY: EncodeParams; rows index `keys` ([rows][Hkv][D] uploaded above) and write
            // summaries at positions start..end < capacity of `seq`.
            unsafe { self.launch("encode", &p, grid, 128, 0) }?;
        }
        self.len[seq] = end;
        let lens: Vec<u32> = self.len.iter().map(|&n| n as u32).collect();
        st.memcpy_htod(&lens, &mut self.len_d).map_err(drv("lengths"))?;
        st.synchronize().map_err(drv("paris encode"))?;
        Ok(())
    }

    /// The summaries of (`seq`, kv head `head`) as the reference type (tests compare them
    /// with `kvforge_paris::Summaries::encode`). Downloads the whole index. The seed's layout
    /// only (Whole64: [`ParisIndex::download_whole`]).
    pub fn download_summaries(&self, seq: usize, head: usize) -> Result<kvforge_paris::Summaries> {
        self.check_head(seq, head)?;
        if self.geo.layout != SummaryLayout::Subspace4 {
            return Err(RtError::BadInput(format!("ParisKV download_summaries: the index keeps {} summaries; use download_whole", self.geo.layout.name())));
        }
        let (d, b, c, n) = (self.cfg.head_dim, self.cfg.subspaces, self.cfg.centroids(), self.len[seq]);
        let sh = seq * self.geo.kv_heads + head;
        let base = sh * self.geo.capacity;
        let ids = self.st.clone_dtoh(&self.ids).map_err(drv("centroid ids"))?;
        let codes = self.st.clone_dtoh(&self.codes).map_err(drv("codes"))?;
        let weights = self.st.clone_dtoh(&self.weights).map_err(drv("weights"))?;
        let hist = self.st.clone_dtoh(&self.hist).map_err(drv("occupancy"))?;
        Ok(kvforge_paris::Summaries {
            config: self.cfg,
            n,
            ids: ids[base * b..(base + n) * b].to_vec(),
            codes: codes[base * d / 2..(base + n) * d / 2].to_vec(),
            weights: weights[base * b..(base + n) * b].to_vec(),
            hist: hist[sh * b * c..(sh + 1) * b * c].to_vec(),
        })
    }

    /// The Whole64 summaries of (`seq`, kv head `head`): the ids `[n][B]`, the occupancy
    /// `[B][2^m]` and the codes unpacked on the (sequence, kv head)'s weight grid (tests compare
    /// them with `kvforge_paris::CompactSummaries::on_grid` and `WholeRow::pack`). Downloads the
    /// whole index.
    pub fn download_whole(&self, seq: usize, head: usize) -> Result<(Vec<u8>, Vec<u32>, CompactSummaries)> {
        self.check_head(seq, head)?;
        if self.geo.layout != SummaryLayout::Whole64 {
            return Err(RtError::BadInput(format!("ParisKV download_whole: the index keeps {} summaries; use download_summaries", self.geo.layout.name())));
        }
        let (d, b, c, n) = (self.cfg.head_dim, self.cfg.subspaces, self.cfg.centroids(), self.len[seq]);
        let row = 3 * d / 8;
        let sh = seq * self.geo.kv_heads + head;
        let base = sh * self.geo.capacity;
        let ids = self.st.clone_dtoh(&self.ids).map_err(drv("centroid ids"))?;
        let rows = self.st.clone_dtoh(&self.codes).map_err(drv("rows"))?;
        let hist = self.st.clone_dtoh(&self.hist).map_err(drv("occupancy"))?;
        let tops = self.st.clone_dtoh(&self.wtop).map_err(drv("weight grids"))?;
        let grid = LogGrid { steps: 32, base: if tops[sh] == i32::MIN { -128 } else { tops[sh] - 255 } };
        let ids = ids[base * b..(base + n) * b].to_vec();
        let compact = CompactSummaries::from_whole_rows(self.cfg, &ids, &rows[base * row..(base + n) * row], grid)?;
        Ok((ids, hist[sh * b * c..(sh + 1) * b * c].to_vec(), compact))
    }

    fn check_head(&self, seq: usize, head: usize) -> Result<()> {
        self.check_seq(seq)?;
        if head >= self.geo.kv_heads {
            return Err(RtError::NoKvHead { head, heads: self.geo.kv_heads });
        }
        Ok(())
    }

    /// Sets the dense rows of `seq` (sinks, local window, update buffer): `[rows][kv_heads][D]`.
    pub fn set_dense(&mut self, seq: usize, keys: &[f16], values: &[f16]) -> Result<()> {
        self.check_seq(seq)?;
        let (d, hkv) = (self.cfg.head_dim, self.geo.kv_heads);
        if keys.len() != values.len() || !keys.len().is_multiple_of(hkv * d) {
            return Err(RtError::BadInput("ParisKV set_dense: keys and values must both be [rows][kv_heads][D]".into()));
        }
        let rows = keys.len() / (hkv * d);
        if rows > self.geo.dense_capacity {
            return Err(RtError::CapacityExceeded { what: "ParisKV dense rows".into(), requested: rows.to_string(), capacity: self.geo.dense_capacity.to_string() });
        }
        let mut kh = self.st.clone_dtoh(&self.dense_k).map_err(drv("dense keys"))?;
        let mut vh = self.st.clone_dtoh(&self.dense_v).map_err(drv("dense values"))?;
        for r in 0..rows {
            for h in 0..hkv {
                let dst = ((seq * hkv + h) * self.geo.dense_capacity + r) * d;
                let src = (r * hkv + h) * d;
                kh[dst..dst + d].copy_from_slice(bits(&keys[src..src + d]));
                vh[dst..dst + d].copy_from_slice(bits(&values[src..src + d]));
            }
        }
        self.st.memcpy_htod(&kh, &mut self.dense_k).map_err(drv("dense keys"))?;
        self.st.memcpy_htod(&vh, &mut self.dense_v).map_err(drv("dense values"))?;
        self.dense_len[seq] = rows;
        let lens: Vec<u32> = self.dense_len.iter().map(|&n| n as u32).collect();
        self.st.memcpy_htod(&lens, &mut self.dense_len_d).map_err(drv("dense lengths"))?;
        Ok(())
    }

    /// Uploads the queries `[batch][kv_heads · gqa][D]` and the per-sequence plan, in one copy
    /// from pinned memory.
    fn prepare(&mut self, q: &[f16], k: usize, schedule: &Schedule) -> Result<()> {
        let d = self.cfg.head_dim;
        let qh = self.geo.batch * self.geo.kv_heads * self.geo.gqa;
        if q.len() != qh * d {
            return Err(RtError::ShapeMismatch { what: "ParisKV queries".into(), expected: format!("[{}][{}][{d}]", self.geo.batch, self.geo.kv_heads * self.geo.gqa), got: format!("{} values", q.len()) });
        }
        if k == 0 || k > self.geo.max_k {
            return Err(RtError::BadInput(format!("ParisKV top-k {k}: must be 1 to {}", self.geo.max_k)));
        }
        schedule.validate()?;
        let (batch, qw, cmax) = (self.geo.batch, q.len().div_ceil(2), self.geo.max_candidates);
        let host = self.ws.stage_queries(q)?;
        for (i, &n) in self.len.iter().enumerate() {
            let plan = schedule.plan(n, k);
            let candidates = plan.candidates.clamp(plan.k, cmax);
            host[qw + Inputs::Target as usize * batch + i] = ((plan.rho * n as f64).ceil() as u32).max(1);
            host[qw + Inputs::Candidates as usize * batch + i] = candidates as u32;
            host[qw + Inputs::TopK as usize * batch + i] = plan.k as u32;
            self.plan_candidates[i] = candidates;
        }
        self.ws.upload_inputs(&self.st)
    }

    fn launch_vote(&self, span: Span) -> Result<()> {
        let g = &self.geo;
        let nr = span.n * g.rows_per_sequence();
        let w = &self.ws;
        let bp = BonusParams {
            q: self.q_at(span),
            hist: self.at(&self.hist, span),
            target: self.plan_at(Inputs::Target, span),
            qrot: self.at(&w.qrot, span),
            qnorm: self.at(&w.qnorm, span),
            bonus: self.at(&w.bonus, span),
            score_hist: self.at(&w.score_hist, span),
            est_hist: self.at(&w.est_hist, span),
            nr: g.rows_per_sequence() as i32,
            rg: g.rows_per_kv_head() as i32,
            share: (g.gqa / g.rows_per_kv_head()) as i32,
            hkv: g.kv_heads as i32,
            seed: self.cfg.seed,
        };
        // SAFETY: BonusParams; buffers sized [batch][NR][...] in `new` (queries [batch][Hq][D],
        // NR × share = Hq); a CTA per (sequence, retrieval row, subspace).
        unsafe { self.launch("bonus", &bp, (nr as u32, self.cfg.subspaces as u32, 1), 256, 0) }?;
        let vp = VoteParams {
            ids: self.at(&self.ids, span),
            len: self.at(&self.len_d, span),
            bonus: self.at(&w.bonus, span),
            scores: self.at(&w.scores, span),
            score_hist: self.at(&w.score_hist, span),
            cap: g.capacity as i32,
            hkv: g.kv_heads as i32,
            sstride: score_stride(g.capacity) as i32,
        };
        let most = self.most(span);
        // SAFETY: VoteParams; CTAs and keys past a sequence's length return; score rows are
        // `sstride` (a multiple of 16) long, so the 4-key stores stay in their row.
        // One row per kv head reads the byte tables the bonus kernel writes when RG = 1.
        let entry = if g.rows_per_kv_head() == 1 { "vote" } else { "vote_heads" };
        unsafe { self.launch(entry, &vp, (most.div_ceil(VOTE_CHUNK) as u32, (span.n * g.kv_heads) as u32, 1), 256, 0) }?;
        Ok(())
    }

    fn select_params(&self, topk: bool, span: Span) -> SelectParams {
        let (g, w) = (&self.geo, &self.ws);
        SelectParams {
            scores: self.at(&w.scores, span),
            est: self.at(&w.est, span),
            cand: self.at(&w.cand, span),
            n: self.at(&self.len_d, span),
            count: self.at(&w.cand_count, span),
            want: self.plan_at(if topk { Inputs::TopK } else { Inputs::Candidates }, span),
            out: if topk { self.at(&w.top, span) } else { self.at(&w.cand, span) },
            out_count: if topk { self.at(&w.top_count, span) } else { self.at(&w.cand_count, span) },
            est_hist: self.at(&w.est_hist, span),
            cap: score_stride(g.capacity) as i32,
            cmax: g.max_candidates as i32,
            stride: if topk { g.max_k as i32 } else { g.max_candidates as i32 },
            nr: g.rows_per_sequence() as i32,
        }
    }

    fn launch_select(&self, topk: bool, span: Span) -> Result<()> {
        let nr = span.n * self.geo.rows_per_sequence();
        let most = self.most_candidates(span);
        if topk && !self.radix_topk && nr <= self.ws.split.rows && self.split_topk.unwrap_or(split_topk_by_default(nr, most, self.sms)) {
            return self.launch_topk_split(span);
        }
        let p = self.select_params(topk, span);
        // The one-pass top-k reads the rerank's histogram; the radix top-k stages the estimates
        // in shared memory when a row of them fits (with the kernel's static 4 KiB and the
        // block-select scratch).
        let staged_bytes = self.geo.max_candidates * 4;
        let staged = topk && self.radix_topk && staged_bytes + 8 * 1024 <= self.max_smem;
        let entry = match (topk, self.radix_topk, staged) {
            (false, _, _) => "select",
            (true, false, _) => "topk_hist",
            (true, true, false) => "topk",
            (true, true, true) => "topk_staged",
        };
        let smem = if staged { staged_bytes } else { 0 };
        // SAFETY: SelectParams; select writes at most `stride` candidates per (sequence, query
        // head), top-k at most max_k ≤ 1024; the staged top-k's dynamic shared memory holds
        // max_candidates ≥ count floats.
        unsafe { self.launch(entry, &p, (nr as u32, 1, 1), 1024, smem) }
    }

    /// The one-pass top-k over `TOPK_CHUNK` estimates per CTA: per-chunk counts and the threshold
    /// bin, then each chunk's keys at their positions, the threshold bin's resolved by the
    /// row's last CTA.
    fn launch_topk_split(&self, span: Span) -> Result<()> {
        let (g, w, sc) = (&self.geo, &self.ws, &self.ws.split);
        let nr = span.n * g.rows_per_sequence();
        let most = self.most_candidates(span);
        let chunks = most.div_ceil(TOPK_CHUNK).clamp(1, sc.chunks);
        let ptr = |b: &CudaSlice<u32>| b.device_ptr(&self.st).0;
        let p = TopkSplitParams {
            est: self.at(&w.est, span),
            cand: self.at(&w.cand, span),
            count: self.at(&w.cand_count, span),
            want: self.plan_at(Inputs::TopK, span),
            est_hist: self.at(&w.est_hist, span),
            chunk_gt: ptr(&sc.chunk_gt),
            chunk_eq: ptr(&sc.chunk_eq),
            thresh: ptr(&sc.thresh),
            done: ptr(&sc.done),
            tie_key: ptr(&sc.tie_key),
            tie_pos: ptr(&sc.tie_pos),
            out: self.at(&w.top, span),
            out_count: self.at(&w.top_count, span),
            cmax: g.max_candidates as i32,
            stride: g.max_k as i32,
            nr: g.rows_per_sequence() as i32,
            chunks: chunks as i32,
        };
        let grid = (chunks as u32, nr as u32, 1);
        // SAFETY: TopkSplitParams; nr ≤ the scratch's rows and chunks ≤ its chunks; the count
        // kernel writes each row's threshold and zeroes its counter before the emit kernel (same
        // stream) reads them; a row's candidates (≤ its top-C size ≤ chunks × TOPK_CHUNK) are
        // covered by the grid.
        unsafe {
            self.launch("topk_split_count", &p, grid, 256, 0)?;
            self.launch("topk_split_emit", &p, grid, 256, 0)
        }
    }

    /// The top-C of the collision scores over many CTAs: per-chunk counts, then each chunk's
    /// candidates at their index-order positions.
    fn launch_bucket(&self, span: Span) -> Result<()> {
        let (g, w) = (&self.geo, &self.ws);
        let nr = span.n * g.rows_per_sequence();
        let chunks = g.capacity.div_ceil(BUCKET_CHUNK);
        let wide = self.wide_bucket.unwrap_or(wide_bucket_by_default(nr, self.most(span), self.sms));
        let live = self.most(span).div_ceil(if wide { BUCKET_CHUNK_WIDE } else { BUCKET_CHUNK });
        let p = BucketParams {
            scores: self.at(&w.scores, span),
            hist: self.at(&w.score_hist, span),
            n: self.at(&self.len_d, span),
            want: self.plan_at(Inputs::Candidates, span),
            chunk_gt: self.at(&w.chunk_gt, span),
            chunk_eq: self.at(&w.chunk_eq, span),
            out: self.at(&w.cand, span),
            out_count: self.at(&w.cand_count, span),
            cap: score_stride(g.capacity) as i32,
            stride: g.max_candidates as i32,
            nr: g.rows_per_sequence() as i32,
            chunks: chunks as i32,
        };
        let grid = (live as u32, nr as u32, 1);
        // SAFETY: BucketParams; chunk arrays hold `chunks` ≥ `live` entries per row (the wide
        // form's chunks are 4 of the narrow's); emit writes at most min(want, stride)
        // candidates per row.
        let (count, emit) = if wide { ("bucket_count_wide", "bucket_emit_wide") } else { ("bucket_count", "bucket_emit") };
        unsafe {
            self.launch(count, &p, grid, 256, 0)?;
            self.launch(emit, &p, grid, 256, 0)
        }
    }

    fn launch_rerank(&self, span: Span) -> Result<()> {
        let (g, w) = (&self.geo, &self.ws);
        let nr = span.n * g.rows_per_sequence();
        let chunk = rerank_chunk(g.max_candidates, nr, self.sms);
        let p = RerankParams {
            ix: self.raw(span),
            qrot: self.at(&w.qrot, span),
            qnorm: self.at(&w.qnorm, span),
            cand: self.at(&w.cand, span),
            count: self.at(&w.cand_count, span),
            est: self.at(&w.est, span),
            est_hist: self.at(&w.est_hist, span),
            q: self.q_at(span),
            cmax: g.max_candidates as i32,
            nr: g.rows_per_sequence() as i32,
            rg: g.rows_per_kv_head() as i32,
            chunk: chunk as i32,
            seed: self.cfg.seed,
            levels: self.levels,
            low: self.low,
        };
        let grid = (g.max_candidates.div_ceil(chunk) as u32, nr as u32, 1);
        let whole = g.layout == SummaryLayout::Whole64;
        if g.ranks_by_group_max() {
            // SAFETY: RerankParams; one row per kv head (RG = 1), whose gqa ≤ HMAX_MAX_GQA
            // query heads are row × gqa .. of the uploaded queries [batch][Hq][D]; the dynamic
            // shared memory holds the [D][16] lookup entries of hmax_pairs(gqa) half2; CTAs and
            // threads past a row's candidate count return.
            // Whole64 (rerank_whole_hmax): the same table of [D][16] entries, and the rows of
            // ids and codes allocated for its layout.
            unsafe { self.launch(if whole { "rerank_whole_hmax" } else { "rerank_hmax" }, &p, grid, 256, hmax_lut_bytes(self.cfg.head_dim, g.gqa)) }
        } else {
            // SAFETY: RerankParams; CTAs and threads past a row's candidate count return; the
            // codes array holds the launched layout's rows.
            unsafe { self.launch(if whole { "rerank_whole" } else { "rerank" }, &p, grid, 256, 0) }
        }
    }

    fn launch_fetch(&self, st: &CudaStream, span: Span) -> Result<()> {
        let (g, w) = (&self.geo, &self.ws);
        let nr = span.n * g.rows_per_sequence();
        let host_off = self.host_offset(span);
        // 16-byte pieces of the k rows' K and V per retrieval row.
        let pieces = 2 * g.max_k * self.cfg.head_dim * 2 / 16;
        let (per_cta, ctas) = fetch_grid(pieces, nr, self.sms, self.fetch_ctas);
        let p = FetchParams {
            host_k: self.host_k_ptr + host_off,
            host_v: self.host_v_ptr + host_off,
            top: self.at(&w.top, span),
            top_count: self.at(&w.top_count, span),
            k_out: self.at(&w.k_rows, span),
            v_out: self.at(&w.v_rows, span),
            error_flags: self.err_ptr(),
            len: self.at(&self.len_d, span),
            host_cap: g.capacity as i32,
            kmax: g.max_k as i32,
            nr: g.rows_per_sequence() as i32,
            rg: g.rows_per_kv_head() as i32,
            hkv: g.kv_heads as i32,
            host_stride: (2 * self.cfg.head_dim) as i32,
            per_cta: per_cta as i32,
            rows: nr as i32,
        };
        // SAFETY: FetchParams; host_k/host_v point into the DEVICEMAP pinned slab (UVA
        // addresses) at stride host_stride; rows past a sequence's length are flagged, not read;
        // pieces past the row's count skip; per_cta is a multiple of the CTA's threads and at
        // most FETCH_THREADS × FETCH_UNROLL.
        unsafe { self.launch_on(st, "fetch", &p, (ctas as u32, 1, 1), FETCH_THREADS as u32, 0) }
    }

    /// Attention of `span`'s query heads; `merge`, a block of the same queries over other keys,
    /// is folded into its output (its `ready` event must be waited for on `st` before).
    fn launch_attend(&self, st: &CudaStream, fused: bool, span: Span, merge: Option<&DenseBlock>) -> Result<()> {
        let (g, w) = (&self.geo, &self.ws);
        let qh = span.n * g.kv_heads * g.gqa;
        let host_off = self.host_offset(span);
        // The merged block's rows of the span: [batch][Hq][D] 16-bit values, [batch][Hq] f32.
        let rows0 = (span.s0 * g.kv_heads * g.gqa) as u64;
        let (merge_out, merge_lse, merge_bf16) = merge.map_or((0, 0, 0), |m| (m.out + rows0 * self.cfg.head_dim as u64 * 2, m.lse + rows0 * 4, i32::from(m.bf16)));
        let p = AttendParams {
            q: self.q_at(span),
            dense_k: self.at(&self.dense_k, span),
            dense_v: self.at(&self.dense_v, span),
            dense_len: self.at(&self.dense_len_d, span),
            k_rows: self.at(&w.k_rows, span),
            v_rows: self.at(&w.v_rows, span),
            host_k: self.host_k_ptr + host_off,
            host_v: self.host_v_ptr + host_off,
            top: self.at(&w.top, span),
            top_count: self.at(&w.top_count, span),
            out: self.out_at(span),
            lse: self.lse_at(span),
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
            dense_cap: g.dense_capacity as i32,
            host_cap: g.capacity as i32,
            kmax: g.max_k as i32,
            hq: (g.kv_heads * g.gqa) as i32,
            hkv: g.kv_heads as i32,
            share: (g.gqa / g.rows_per_kv_head()) as i32,
            host_stride: (2 * self.cfg.head_dim) as i32,
            merge_out,
            merge_lse,
            merge_bf16,
        };
        let smem = (g.dense_capacity + g.max_k) * 4 + if fused { g.max_k * 4 } else { 0 };
        // SAFETY: AttendParams; dynamic shared memory holds dense_cap + max_k logits (fused: and
        // max_k indices); the fused kernel reads retrieved rows at `top` < len (checked by the
        // retrieval, which selects among indexed keys only) at stride host_stride.
        unsafe { self.launch_on(st, if fused { "attend_fused" } else { "attend" }, &p, (qh as u32, 1, 1), 256, smem) }
    }

    /// Retrieves the top-`k` keys for queries `q` (`[batch][Hq][D]` fp16) under `schedule`'s
    /// `(ρ, β)` for each sequence's length: one retrieval per (sequence, kv head) for the sum of
    /// its query heads (candidates ranked by [`ParisGeometry::rank`]), or per query head
    /// ([`ParisGeometry::per_query_head`]). Returns the key
    /// indices each (sequence, query head) attends, ascending (the query heads of a kv head get
    /// the same list unless per query head).
    pub fn retrieve(&mut self, q: &[f16], k: usize, schedule: &Schedule) -> Result<Vec<Vec<u32>>> {
        self.prepare(q, k, schedule)?;
        self.launch_retrieval(self.all())?;
        self.download_top()
    }

    /// Bonus + vote, top-C, rerank and top-k of the sequences of `span`, on the main stream.
    fn launch_retrieval(&self, span: Span) -> Result<()> {
        self.launch_vote(span)?;
        self.launch_bucket(span)?;
        self.launch_rerank(span)?;
        self.launch_select(true, span)
    }

    /// One whole decode step (retrieval, staged fetch, attention) pipelined over `chunks` spans
    /// of the batch: while the main stream retrieves span `c + 1` (HBM-bound kernels), the fetch
    /// stream reads span `c`'s rows over the host link and attends it. The outputs are those of
    /// [`ParisIndex::retrieve`] then [`ParisIndex::attend`] (`fused = false`), bit for bit:
    /// every kernel sees the same inputs, only the order of launches across spans changes.
    /// `(out [batch][Hq][D], lse [batch][Hq])`.
    pub fn step(&mut self, q: &[f16], k: usize, schedule: &Schedule, chunks: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.prepare(q, k, schedule)?;
        self.launch_step(chunks)?;
        self.finish()
    }

    /// [`ParisIndex::step`] whose output is merged on the device with a softmax block of the same
    /// queries over other keys (the main cache's GPU region, `kvforge_rt::retrieval`) before the
    /// one download: `(out, lse)` of one softmax over both, and the device time of the whole
    /// step in µs (CUDA events on this index's stream from before the inputs' upload to after
    /// the last attention, which waits for the block). Query heads with no retrieved rows (an
    /// empty retrieval region) return the other block alone.
    ///
    /// `dense` launches that block's work on another stream and returns where it lands with an
    /// event recorded behind it. It is called once the first span's retrieval is queued, so its
    /// kernels run beside the retrieval; the attention waits for its event and folds the block
    /// into its epilogue (no merge launch).
    pub fn step_merged(&mut self, q: &[f16], k: usize, schedule: &Schedule, chunks: usize, dense: impl FnOnce() -> Result<DenseBlock>) -> Result<(Vec<f32>, Vec<f32>, f64)> {
        let t0 = self.st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
        self.prepare(q, k, schedule)?;
        self.launch_spans_with(chunks, Some(dense))?;
        self.join_fetch()?;
        let t1 = self.st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
        let (out, lse) = self.finish()?;
        let us = f64::from(t0.elapsed_ms(&t1).map_err(drv("event"))?) * 1e3;
        Ok((out, lse, us))
    }

    /// The spans [`ParisIndex::step`] pipelines a batch over by default: one below 16
    /// sequences (the fetch is short, and more launches cost more than the overlap saves), two
    /// from 16, four from 32, where the fetch of one span runs beside the retrieval of the next.
    pub fn default_chunks(&self) -> usize {
        match self.geo.batch {
            0..16 => 1,
            16..32 => 2,
            _ => 4,
        }
    }

    fn launch_step(&self, chunks: usize) -> Result<()> {
        self.launch_spans(chunks)?;
        self.join_fetch()
    }

    /// Each span's retrieval on the main stream, then its fetch and attention on the fetch
    /// stream once that retrieval is done (the next span's retrieval runs beside them).
    fn launch_spans(&self, chunks: usize) -> Result<()> {
        self.launch_spans_with(chunks, None::<fn() -> Result<DenseBlock>>)
    }

    /// [`ParisIndex::launch_spans`], folding the block `dense` launches (after the first span's
    /// retrieval is queued) into every attention, which waits for it.
    fn launch_spans_with(&self, chunks: usize, dense: Option<impl FnOnce() -> Result<DenseBlock>>) -> Result<()> {
        let mut dense = dense;
        let mut block = None;
        for span in spans(self.geo.batch, chunks) {
            self.launch_retrieval(span)?;
            let ready = self.st.record_event(None).map_err(drv("event"))?;
            self.fetch_st.wait(&ready).map_err(drv("event"))?;
            self.launch_fetch(&self.fetch_st, span)?;
            if let Some(launch) = dense.take() {
                let b = launch()?;
                self.fetch_st.wait(&b.ready).map_err(drv("event"))?;
                block = Some(b);
            }
            self.launch_attend(&self.fetch_st, false, span, block.as_ref())?;
        }
        Ok(())
    }

    /// The main stream waits for the fetch stream's work queued so far.
    fn join_fetch(&self) -> Result<()> {
        let done = self.fetch_st.record_event(None).map_err(drv("event"))?;
        self.st.wait(&done).map_err(drv("event"))
    }

    /// [`ParisIndex::step`] timed by CUDA events around the whole pipelined step: the outputs
    /// and the device time in microseconds.
    pub fn step_pipelined_timed(&mut self, q: &[f16], k: usize, schedule: &Schedule, chunks: usize) -> Result<(Vec<f32>, f64)> {
        self.prepare(q, k, schedule)?;
        let t0 = self.st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
        self.launch_step(chunks)?;
        let t1 = self.st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
        t1.synchronize().map_err(drv("event"))?;
        let us = f64::from(t0.elapsed_ms(&t1).map_err(drv("event"))?) * 1e3;
        let (out, _) = self.finish()?;
        Ok((out, us))
    }

    fn download_top(&self) -> Result<Vec<Vec<u32>>> {
        let top = self.st.clone_dtoh(&self.ws.top).map_err(drv("top-k"))?;
        let count = self.st.clone_dtoh(&self.ws.top_count).map_err(drv("top-k counts"))?;
        let share = self.geo.gqa / self.geo.rows_per_kv_head();
        let rows: Vec<Vec<u32>> = count
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let mut v = top[i * self.geo.max_k..i * self.geo.max_k + c as usize].to_vec();
                v.sort_unstable();
                v
            })
            .collect();
        // Query head j of a sequence attends retrieval row j / share.
        Ok((0..rows.len() * share).map(|j| rows[j / share].clone()).collect())
    }

    /// The vote's candidates of every retrieval row (`[batch][rows_per_sequence]`) of the last
    /// retrieval, ascending.
    pub fn candidates(&self) -> Result<Vec<Vec<u32>>> {
        let cand = self.st.clone_dtoh(&self.ws.cand).map_err(drv("candidates"))?;
        let count = self.st.clone_dtoh(&self.ws.cand_count).map_err(drv("candidate counts"))?;
        Ok(count.iter().enumerate().map(|(i, &c)| cand[i * self.geo.max_candidates..i * self.geo.max_candidates + c as usize].to_vec()).collect())
    }

    /// Attention of the last retrieval's queries over each sequence's dense rows and retrieved
    /// rows, one softmax (scale 1/√D): `(out [batch][Hq][D], lse [batch][Hq])`. `fused` reads
    /// the retrieved rows from pinned host memory inside the attention kernel; otherwise a
    /// fetch kernel stages them on the GPU first.
    pub fn attend(&mut self, q: &[f16], fused: bool) -> Result<(Vec<f32>, Vec<f32>)> {
        let expected = self.geo.batch * self.geo.kv_heads * self.geo.gqa * self.cfg.head_dim;
        if q.len() != expected {
            return Err(RtError::ShapeMismatch { what: "ParisKV queries".into(), expected: format!("{expected} values"), got: format!("{} values", q.len()) });
        }
        // The plan words stay those of the last `prepare`.
        self.ws.stage_queries(q)?;
        self.ws.upload_inputs(&self.st)?;
        if !fused {
            self.launch_fetch(&self.st, self.all())?;
        }
        self.launch_attend(&self.st, fused, self.all(), None)?;
        self.finish()
    }

    /// Downloads the step's output, log-sum-exp and error flags in one copy and waits for it.
    fn finish(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        let qh = self.geo.batch * self.geo.kv_heads * self.geo.gqa;
        let d = self.cfg.head_dim;
        self.st.memcpy_dtoh(&self.ws.result, &mut self.ws.result_host).map_err(drv("output"))?;
        self.ws.landed.record(&self.st).map_err(drv("output event"))?;
        self.ws.landed.synchronize().map_err(drv("output"))?;
        let host = self.ws.result_host.as_slice().map_err(drv("output"))?;
        let err = host[qh * d + qh];
        if err != 0 {
            let mut flags = self.ws.result.slice_mut(qh * d + qh..);
            self.st.memcpy_htod(&[0u32], &mut flags).map_err(drv("error flags"))?;
            return Err(RtError::BadInput(format!("ParisKV fetch: a retrieved index lies past its sequence's retrieval region (flags {err:#x})")));
        }
        let out = host[..qh * d].iter().map(|&b| f32::from_bits(b)).collect();
        let lse = host[qh * d..qh * d + qh].iter().map(|&b| f32::from_bits(b)).collect();
        Ok((out, lse))
    }

    /// One decode step (retrieve, fetch, attend; staged fetch) with CUDA events between the
    /// phases: the outputs and the device time of each; then, timed alone, the fused attention
    /// that reads the retrieved rows from host memory itself.
    pub fn step_timed(&mut self, q: &[f16], k: usize, schedule: &Schedule) -> Result<(Vec<f32>, StepTimes)> {
        self.prepare(q, k, schedule)?;
        let mut e = Vec::with_capacity(9);
        for _ in 0..9 {
            e.push(self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?);
        }
        let st = self.st.clone();
        let mark = |i: usize| e[i].record(&st).map_err(drv("event"));
        let all = self.all();
        mark(0)?;
        self.launch_vote(all)?;
        mark(1)?;
        self.launch_bucket(all)?;
        mark(2)?;
        self.launch_rerank(all)?;
        mark(3)?;
        self.launch_select(true, all)?;
        mark(4)?;
        self.launch_fetch(&self.st, all)?;
        mark(5)?;
        self.launch_attend(&self.st, false, all, None)?;
        mark(6)?;
        let (out, _) = self.finish()?;
        mark(7)?;
        self.launch_attend(&self.st, true, all, None)?;
        mark(8)?;
        e[8].synchronize().map_err(drv("event"))?;
        let us = |a: usize, z: usize| -> Result<f64> { Ok(f64::from(e[a].elapsed_ms(&e[z]).map_err(drv("event"))?) * 1e3) };
        let t = StepTimes { vote_us: us(0, 1)?, topk_us: us(1, 2)? + us(3, 4)?, rerank_us: us(2, 3)?, fetch_us: us(4, 5)?, attend_us: us(5, 6)?, attend_fused_us: us(7, 8)? };
        Ok((out, t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_grid_keeps_its_reads_in_flight_and_spreads_small_fetches() {
        // k 100 of max_k 128 at D 128: 4096 pieces per retrieval row; 132 SMs (H100 / H200).
        let pieces = 2 * 128 * 128 * 2 / 16;
        // 128K x 64 (512 rows): whole CTAs of 1024 pieces, 8 of them (128 KiB in flight).
        assert_eq!(fetch_grid(pieces, 512, 132, None), (1024, 8));
        // batch 1 (8 rows): 128-piece CTAs over the SMs, 64 of them, the same reads in flight.
        assert_eq!(fetch_grid(pieces, 8, 132, None), (128, 64));
        // A cap overrides the budget; neither passes the work items.
        assert_eq!(fetch_grid(pieces, 512, 132, Some(264)), (1024, 264));
        assert_eq!(fetch_grid(128, 1, 132, None), (128, 1));
        for rows in [1, 3, 8, 64, 512, 4096] {
            let (per_cta, ctas) = fetch_grid(pieces, rows, 132, None);
            assert!(per_cta % FETCH_THREADS == 0 && per_cta <= FETCH_THREADS * FETCH_UNROLL && ctas >= 1);
            assert!(per_cta * ctas <= FETCH_IN_FLIGHT, "{rows} rows: {per_cta} x {ctas}");
        }
        // No SM count: whole CTAs.
        assert_eq!(fetch_per_cta(pieces, 8, 0), FETCH_THREADS * FETCH_UNROLL);
    }

    #[test]
    fn spans_cover_the_batch_once_in_order() {
        for batch in [1, 2, 7, 8, 64] {
            for chunks in [0, 1, 2, 3, 8, 100] {
                let v = spans(batch, chunks);
                assert_eq!(v.len(), chunks.clamp(1, batch), "{batch} {chunks}");
                let mut next = 0;
                for s in &v {
                    assert_eq!(s.s0, next);
                    assert!(s.n > 0);
                    next += s.n;
                }
                assert_eq!(next, batch);
                let (lo, hi) = (v.iter().map(|s| s.n).min().unwrap(), v.iter().map(|s| s.n).max().unwrap());
                assert!(hi - lo <= 1, "{batch} {chunks}: {v:?}");
            }
        }
    }

    #[test]
    fn top_c_and_top_k_forms_follow_the_measured_shapes() {
        // H200 (132 SMs), one retrieval row per kv head, 8 kv heads (paris-bench-split-topk,
        // paris-bench-bucket-wide): 1M × 1 (top-C 52429) takes both, 128K × 1 (13108) neither,
        // 128K × 64 (512 rows) the wide bucket only.
        assert!(split_topk_by_default(8, 52_429, 132) && wide_bucket_by_default(8, 1 << 20, 132));
        assert!(!split_topk_by_default(8, 13_108, 132) && !wide_bucket_by_default(8, 1 << 17, 132));
        assert!(!split_topk_by_default(512, 13_108, 132) && wide_bucket_by_default(512, 1 << 17, 132));
    }

    #[test]
    fn rerank_chunks_shrink_only_where_rows_are_few() {
        // 128K × batch 1 (β 0.10): 8 rows of 13108 candidates, 26 CTAs a row instead of 7.
        assert_eq!(rerank_chunk(13108, 8, 132), RERANK_STEP);
        // 1M × batch 1 (β 0.05): 8 rows of 52429 candidates already make 208 CTAs.
        assert_eq!(rerank_chunk(52429, 8, 132), RERANK_CHUNK);
        // 128K × batch 64 (β 0.10): 512 rows fill the GPU at the full chunk.
        assert_eq!(rerank_chunk(13108, 512, 132), RERANK_CHUNK);
        for (cmax, rows) in [(1, 1), (800, 8), (13108, 8), (13108, 64), (52429, 32), (1 << 20, 1)] {
            let c = rerank_chunk(cmax, rows, 132);
            assert!(c.is_multiple_of(RERANK_STEP) && (RERANK_STEP..=RERANK_CHUNK).contains(&c), "{cmax} × {rows}: {c}");
        }
        assert_eq!(rerank_chunk(52429, 8, 0), RERANK_CHUNK);
    }
}
