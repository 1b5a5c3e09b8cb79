//! kvtc restore on the device (seed 003; codec and f64 reference: kvforge-kvtc).
//!
//! A [`KvtcRestorer`] uploads a calibration once (each side's basis in fp16, padded to whole
//! k-tiles, its mean, RoPE's inverse frequencies) and compiles the generated module
//! (`kvforge_gen::render_kvtc`). [`KvtcRestorer::restore`] takes a container the host has
//! read and entropy-decoded ([`kvforge_kvtc::decode_container`], chunks on all rayon threads)
//! and restores every token of both sides into device buffers, `[layer][token][kv_head ·
//! head_dim + channel]` fp16: kept tokens (sinks, recent window) are copied, coded chunks go
//! through the dequant and restore kernels in batches of up to [`MAX_BATCH_TOKENS`] tokens.
//! [`KvtcRestorer::restore_timed`] also reports the device time of the kernels alone (CUDA
//! events). [`load_sequence`] then appends the restored rows into a new sequence of every
//! layer's [`KvCache`] in a chosen tier, and [`save_sequence`] packs a sequence of those caches.
//!
//! ```ignore
//! let dev = Device::open(0)?;
//! let cal = Calibration::load("calibration.safetensors".as_ref())?;
//! let r = KvtcRestorer::new(&dev, &cal)?;
//! let dc = kvforge_kvtc::decode_container(&mut std::fs::File::open("cache.kvtc")?, &cal)?;
//! let (kv, times) = r.restore_timed(&dc)?;
//! ```

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use kvforge_kvtc::restore::{group_table, padded_components, GroupDesc, BN};
use kvforge_kvtc::{Allocation, Calibration, DecodedContainer, Side};

use crate::device::Device;
use crate::error::{drv, Result, RtError};

/// Most coded tokens one dequant + restore launch pair covers (bounds the coefficient buffer to
/// `MAX_BATCH_TOKENS × components` fp16).
pub const MAX_BATCH_TOKENS: usize = 32768;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct DequantParams {
    packed: u64,
    groups: u64,
    coeff: u64,
    chunks: i32,
    n: i32,
    chunk_bytes: u32,
    n_groups: i32,
    ldc: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RestoreParams {
    coeff: u64,
    basis: u64,
    mean: u64,
    inv_freq: u64,
    positions: u64,
    out: u64,
    rows: i32,
    ldc: i32,
    p: i32,
    layer_width: i32,
    head_dim: i32,
    rope_dim: i32,
    out_rows: i32,
    out_row0: i32,
}

// SAFETY: plain repr(C) structs of integers, mirrored field for field by kvforge/kvtc.cuh.
unsafe impl cudarc::driver::DeviceRepr for DequantParams {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for RestoreParams {}

/// One side's calibration on the device.
struct SideDev {
    /// `[rows][p]` fp16, rows = the largest allocation's padded components (zero past the basis).
    basis: CudaSlice<u16>,
    rows: usize,
    mean: CudaSlice<f32>,
    allocations: Vec<Allocation>,
}

/// Both sides of a restored sequence on the device: `[layer][token][kv_head · head_dim + channel]` fp16 bits.
pub struct RestoredKv {
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    pub tokens: usize,
    pub layers: usize,
    /// `kv_heads · head_dim`.
    pub width: usize,
}

impl RestoredKv {
    /// Downloads layer `l` of one side as `[token][kv_head][head_dim]` fp16 bits.
    pub fn download_layer(&self, st: &Arc<CudaStream>, side: Side, l: usize) -> Result<Vec<u16>> {
        let src = if side == Side::Keys { &self.k } else { &self.v };
        let n = self.tokens * self.width;
        let mut out = vec![0u16; n];
        st.memcpy_dtoh(&src.slice(l * n..(l + 1) * n), &mut out).map_err(drv("kvtc restored rows download"))?;
        Ok(out)
    }
}

/// Device time of one restore (kernels only: dequant + inverse projection of both sides).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct RestoreTimes {
    /// Host → device copies of packed chunks, positions and kept tokens.
    pub upload_ms: f64,
    /// Dequant and restore kernels of both sides.
    pub kernels_ms: f64,
    /// fp16 bytes of the coded tokens written by the kernels (both sides).
    pub coded_output_bytes: usize,
}

/// The compiled module and one calibration on the device.
pub struct KvtcRestorer {
    st: Arc<CudaStream>,
    ctx: Arc<cudarc::driver::CudaContext>,
    dequant: CudaFunction,
    restore: CudaFunction,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    inv_freq: CudaSlice<f64>,
    sides: [SideDev; 2],
    calibration: [u8; 32],
}

fn to_f16_bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&a| half::f16::from_f32(a).to_bits()).collect()
}

impl KvtcRestorer {
    /// Compiles the module and uploads `cal`. A calibration whose heads straddle the matmul's
    /// column tiles (`head_dim` not dividing 128) or whose features are not a multiple of 8 is
    /// a typed error.
    pub fn new(dev: &Device, cal: &Calibration) -> Result<KvtcRestorer> {
        let p = cal.features();
        if !BN.is_multiple_of(cal.head_dim) || !cal.head_dim.is_multiple_of(8) || p > i32::MAX as usize / 2 {
            return Err(RtError::BadInput(format!("kvtc restore needs head_dim dividing {BN} and a multiple of 8 (got {})", cal.head_dim)));
        }
        let st = dev.stream.clone();
        let ctx = dev.ctx.clone();
        let symbol = kvforge_gen::KVTC_SYMBOL;
        let source = kvforge_gen::render_kvtc().map_err(|e| RtError::BadInput(e.to_string()))?;
        let compiled = crate::jit::compile_module(symbol, &source, &dev.info.arch(), false)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin)).map_err(drv(format!("loading {symbol}")))?;
        let f = |e: &str| module.load_function(&format!("{symbol}_{e}")).map_err(drv(format!("symbol {symbol}_{e}")));
        let (dequant, restore) = (f("dequant")?, f("restore")?);
        let side = |side: Side| -> Result<SideDev> {
            let s = cal.side(side);
            let rows = s.allocations.iter().map(padded_components).max().unwrap_or(kvforge_kvtc::restore::BK);
            let mut b = vec![0u16; rows * p];
            let have = s.components().min(rows);
            b[..have * p].copy_from_slice(&to_f16_bits(&s.basis[..have * p]));
            Ok(SideDev { basis: st.clone_htod(&b).map_err(drv("kvtc basis upload"))?, rows, mean: st.clone_htod(&s.mean).map_err(drv("kvtc mean upload"))?, allocations: s.allocations.clone() })
        };
        let sides = [side(Side::Keys)?, side(Side::Values)?];
        let rope_dim = cal.rope.map_or(0, |r| r.dim);
        let inv: Vec<f64> = match cal.rope {
            Some(r) => (0..r.dim / 2).map(|i| r.theta.powf(-2.0 * i as f64 / r.dim as f64)).collect(),
            None => vec![0.0],
        };
        let inv_freq = st.clone_htod(&inv).map_err(drv("kvtc inverse frequencies"))?;
        Ok(KvtcRestorer { st, ctx, dequant, restore, layers: cal.layers, kv_heads: cal.kv_heads, head_dim: cal.head_dim, rope_dim, inv_freq, sides, calibration: cal.id() })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.st
    }

    fn features(&self) -> usize {
        self.layers * self.kv_heads * self.head_dim
    }

    /// Restores every token of `dc` (decoded with this restorer's calibration) into fresh
    /// device buffers; synchronises the stream.
    pub fn restore(&self, dc: &DecodedContainer) -> Result<RestoredKv> {
        Ok(self.restore_timed(dc)?.0)
    }

    /// [`KvtcRestorer::restore`] with the device time of its copies and of its kernels.
    pub fn restore_timed(&self, dc: &DecodedContainer) -> Result<(RestoredKv, RestoreTimes)> {
        if dc.header.calibration != self.calibration {
            return Err(RtError::BadInput("kvtc restore: the container was decoded with another calibration than this restorer's".into()));
        }
        let (tokens, width, layers) = (dc.tokens(), self.kv_heads * self.head_dim, self.layers);
        let st = &self.st;
        let ev = || self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"));
        let (e0, e1, e2) = (ev()?, ev()?, ev()?);
        e0.record(st).map_err(drv("event"))?;
        // SAFETY: fully written below: kept tokens by copies, coded tokens by the restore kernel.
        let mut k = unsafe { st.alloc::<u16>((layers * tokens * width).max(1)) }.map_err(drv("kvtc restored keys"))?;
        // SAFETY: as above.
        let mut v = unsafe { st.alloc::<u16>((layers * tokens * width).max(1)) }.map_err(drv("kvtc restored values"))?;
        self.upload_kept(dc, &mut k, &mut v)?;
        let positions = st.clone_htod(&dc.positions).map_err(drv("kvtc positions"))?;
        let staged = [Side::Keys, Side::Values].map(|side| self.stage(dc, side));
        let staged: Vec<Vec<Batch>> = staged.into_iter().collect::<Result<_>>()?;
        e1.record(st).map_err(drv("event"))?;
        let mut coded_output_bytes = 0;
        for (side, batches) in [Side::Keys, Side::Values].into_iter().zip(&staged) {
            let out = if side == Side::Keys { &mut k } else { &mut v };
            for b in batches {
                self.launch(side, b, &positions, out, tokens)?;
                coded_output_bytes += 2 * b.rows * self.features();
            }
        }
        e2.record(st).map_err(drv("event"))?;
        st.synchronize().map_err(drv("kvtc restore"))?;
        let ms = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| -> Result<f64> { Ok(f64::from(a.elapsed_ms(b).map_err(drv("event"))?)) };
        let times = RestoreTimes { upload_ms: ms(&e0, &e1)?, kernels_ms: ms(&e1, &e2)?, coded_output_bytes };
        Ok((RestoredKv { k, v, tokens, layers, width }, times))
    }

    /// Copies the kept tokens' fp16 rows into their places.
    fn upload_kept(&self, dc: &DecodedContainer, k: &mut CudaSlice<u16>, v: &mut CudaSlice<u16>) -> Result<()> {
        let (tokens, width, d, hkv, nk) = (dc.tokens(), self.kv_heads * self.head_dim, self.head_dim, self.kv_heads, dc.kept.len());
        if nk == 0 {
            return Ok(());
        }
        let per_side = self.layers * hkv * nk * d;
        if dc.kept_fp16.len() != 2 * per_side {
            return Err(RtError::BadInput(format!("kvtc: {} kept fp16 values, expected {}", dc.kept_fp16.len(), 2 * per_side)));
        }
        // runs of consecutive kept tokens (the sinks, the window)
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, &t) in dc.kept.iter().enumerate() {
            match runs.last_mut() {
                Some((start_i, len)) if dc.kept[*start_i] + *len == t => *len += 1,
                _ => runs.push((i, 1)),
            }
        }
        for (s, out) in [k, v].into_iter().enumerate() {
            for l in 0..self.layers {
                let mut rows = vec![0u16; nk * width];
                for h in 0..hkv {
                    for i in 0..nk {
                        let src = s * per_side + ((l * hkv + h) * nk + i) * d;
                        rows[i * width + h * d..][..d].copy_from_slice(&dc.kept_fp16[src..src + d]);
                    }
                }
                for &(i, len) in &runs {
                    let t0 = dc.kept[i];
                    let at = (l * tokens + t0) * width;
                    self.st.memcpy_htod(&rows[i * width..(i + len) * width], &mut out.slice_mut(at..at + len * width)).map_err(drv("kvtc kept rows"))?;
                }
            }
        }
        Ok(())
    }

    /// Uploads one side's coded chunks, grouped into launches of equal-size chunks.
    fn stage(&self, dc: &DecodedContainer, side: Side) -> Result<Vec<Batch>> {
        let alloc_idx = if side == Side::Keys { dc.k_alloc } else { dc.v_alloc };
        let sd = &self.sides[side as usize];
        let alloc = sd.allocations.get(alloc_idx).ok_or_else(|| RtError::BadInput(format!("kvtc: allocation {alloc_idx} not in the calibration")))?;
        let ldc = padded_components(alloc);
        let chunks: Vec<_> = dc.chunks.iter().filter(|c| c.side == side).collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < chunks.len() {
            let n = chunks[i].tokens.len();
            let per = (MAX_BATCH_TOKENS / n).max(1);
            let mut j = i;
            while j < chunks.len() && j - i < per && chunks[j].tokens.len() == n && chunks[j].tokens.start == chunks[i].tokens.start + (j - i) * n {
                j += 1;
            }
            let bytes = chunks[i].raw.len();
            let mut packed = Vec::with_capacity(bytes * (j - i));
            for c in &chunks[i..j] {
                if c.raw.len() != bytes {
                    return Err(RtError::Kvtc(kvforge_kvtc::KvtcError::BadChunk { chunk: c.index, message: format!("{} packed bytes, expected {bytes}", c.raw.len()) }));
                }
                packed.extend_from_slice(&c.raw);
            }
            let table: Vec<GroupRaw> = group_table(alloc, n, ldc).into_iter().map(GroupRaw::from).collect();
            out.push(Batch {
                packed: self.st.clone_htod(&packed).map_err(drv("kvtc packed chunks"))?,
                groups: self.st.clone_htod(&table).map_err(drv("kvtc group table"))?,
                n_groups: table.len(),
                chunks: j - i,
                n,
                chunk_bytes: bytes,
                ldc,
                rows: (j - i) * n,
                first: chunks[i].tokens.start,
            });
            i = j;
        }
        Ok(out)
    }

    /// Dequant + restore of one batch into `out` (`[layer][out_rows][width]`).
    fn launch(&self, side: Side, b: &Batch, positions: &CudaSlice<i64>, out: &mut CudaSlice<u16>, out_rows: usize) -> Result<()> {
        let st = &self.st;
        let sd = &self.sides[side as usize];
        if b.ldc > sd.rows {
            return Err(RtError::BadInput(format!("kvtc: allocation needs {} basis rows, {} uploaded", b.ldc, sd.rows)));
        }
        // SAFETY: every element is written by the dequant kernel (the group table covers 0..ldc).
        let coeff = unsafe { st.alloc::<u16>(b.rows * b.ldc) }.map_err(drv("kvtc coefficients"))?;
        let dp = DequantParams {
            packed: b.packed.device_ptr(st).0,
            groups: b.groups.device_ptr(st).0,
            coeff: coeff.device_ptr(st).0,
            chunks: b.chunks as i32,
            n: b.n as i32,
            chunk_bytes: b.chunk_bytes as u32,
            n_groups: b.n_groups as i32,
            ldc: b.ldc as i32,
        };
        let threads = kvforge_gen::KVTC_DEQUANT_THREADS;
        // SAFETY: DequantParams mirrors the device struct; every pointer is a live allocation of the sizes the kernel reads.
        unsafe { st.launch_builder(&self.dequant).arg(&dp).launch(LaunchConfig { grid_dim: (b.n_groups as u32, b.chunks as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }) }
            .map_err(drv("launch kvtc dequant"))?;
        let p = self.features();
        let rope = side == Side::Keys && self.rope_dim > 0;
        let rp = RestoreParams {
            coeff: coeff.device_ptr(st).0,
            basis: sd.basis.device_ptr(st).0,
            mean: sd.mean.device_ptr(st).0,
            inv_freq: self.inv_freq.device_ptr(st).0,
            positions: positions.device_ptr(st).0 + 8 * b.first as u64,
            out: out.device_ptr(st).0,
            rows: b.rows as i32,
            ldc: b.ldc as i32,
            p: p as i32,
            layer_width: (self.kv_heads * self.head_dim) as i32,
            head_dim: self.head_dim as i32,
            rope_dim: if rope { self.rope_dim as i32 } else { 0 },
            out_rows: out_rows as i32,
            out_row0: b.first as i32,
        };
        let grid = b.rows.div_ceil(128) * p.div_ceil(BN);
        // SAFETY: RestoreParams mirrors the device struct; coeff is rows × ldc, the basis ldc × p
        // (ldc ≤ its rows), out holds layers × out_rows × width and rows first..first+rows exist.
        unsafe { st.launch_builder(&self.restore).arg(&rp).launch(LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }.map_err(drv("launch kvtc restore"))?;
        drop(coeff);
        Ok(())
    }
}

/// One launch pair's input on the device: equal-size consecutive chunks of one side.
struct Batch {
    packed: CudaSlice<u8>,
    groups: CudaSlice<GroupRaw>,
    n_groups: usize,
    chunks: usize,
    n: usize,
    chunk_bytes: usize,
    ldc: usize,
    rows: usize,
    first: usize,
}

/// [`GroupDesc`] as the device reads it (`kvforge::kvtc::GroupDesc`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GroupRaw {
    start: i32,
    len: i32,
    bits: i32,
    offset: u32,
}

impl From<GroupDesc> for GroupRaw {
    fn from(g: GroupDesc) -> Self {
        GroupRaw { start: g.start, len: g.len, bits: g.bits, offset: g.offset }
    }
}

// SAFETY: repr(C) of three i32 and a u32, mirrored by the device struct.
unsafe impl cudarc::driver::DeviceRepr for GroupRaw {}

/// Appends a restored sequence to a new sequence of every layer's cache (`caches[l]` holds layer
/// `l`), full pages encoded into `tier`, and returns the new sequence ids. The rows go through
/// [`KvCache::append`] (staged through the host: the cache has no device bulk encode from fp16
/// rows); the restore before it ran on the device. All or nothing: on any error every sequence
/// added here is removed again and each cache's target tier is left as it was.
pub fn load_sequence(caches: &mut [&mut crate::KvCache], restored: &RestoredKv, tier: kvforge_spec::TierId) -> Result<Vec<usize>> {
    if caches.len() != restored.layers {
        return Err(RtError::ShapeMismatch { what: "kvtc load: caches".into(), expected: format!("{} (one per layer)", restored.layers), got: caches.len().to_string() });
    }
    for c in caches.iter() {
        let t = c.spec.tiers.get(tier as usize).ok_or_else(|| RtError::BadTier(tier, "no such tier".into()))?;
        if t.is_drop() || t.id == kvforge_spec::TAIL_TIER {
            return Err(RtError::BadTier(tier, format!("`{}` cannot hold encoded pages", t.name)));
        }
        if c.cfg.num_kv_heads * c.cfg.head_dim != restored.width {
            return Err(RtError::ShapeMismatch {
                what: "kvtc load: cache rows".into(),
                expected: format!("{} values (kv_heads × head_dim)", restored.width),
                got: (c.cfg.num_kv_heads * c.cfg.head_dim).to_string(),
            });
        }
    }
    let mut added: Vec<usize> = Vec::with_capacity(caches.len());
    let mut fill = |added: &mut Vec<usize>| -> Result<()> {
        for (l, c) in caches.iter_mut().enumerate() {
            let st = c.engine.dev().stream.clone();
            let f = |x: Vec<u16>| -> Vec<f32> { x.into_iter().map(|b| half::f16::from_bits(b).to_f32()).collect() };
            let (k, v) = (f(restored.download_layer(&st, Side::Keys, l)?), f(restored.download_layer(&st, Side::Values, l)?));
            let seq = c.add_sequence();
            added.push(seq);
            let before = c.cfg.target_tier;
            c.cfg.target_tier = tier;
            let r = c.append(seq, &k, &v);
            c.cfg.target_tier = before;
            r?;
        }
        Ok(())
    };
    match fill(&mut added) {
        Ok(()) => Ok(added),
        Err(e) => {
            for (c, &seq) in caches.iter_mut().zip(&added) {
                let _ = c.remove_sequence(seq);
            }
            Err(e)
        }
    }
}

/// Packs sequence `seq` of every layer's cache (`caches[l]` holds layer `l`) with `cal` into
/// `out`. The pages are read back on the host with the f64 reference decoders
/// (`kvforge_ref::decode_page`, every tier the reference knows, radius scales included) and
/// mapped out of the spec's storage basis, so what is packed is what decode attends to (the
/// cache's own reconstruction, not the rows first appended); RoPE positions are the tokens'
/// logical positions (dropped pages leave gaps). A tier the reference cannot decode, or layers
/// and heads that disagree on the sequence's tokens, is a typed error and nothing is written.
pub fn save_sequence(caches: &[&crate::KvCache], seq: usize, cal: &Calibration, opts: &kvforge_kvtc::PackOptions, out: &mut impl std::io::Write) -> Result<kvforge_kvtc::PackStats> {
    let dump = read_sequence(caches, seq, cal)?;
    let mut bytes = Vec::new();
    let stats = kvforge_kvtc::pack_into(&dump, cal, opts, &mut bytes)?;
    out.write_all(&bytes).map_err(|e| RtError::Kvtc(kvforge_kvtc::KvtcError::Stream(e)))?;
    Ok(stats)
}

/// Sequence `seq` of every layer's cache as a kvtc dump (f32), decoded by the f64 reference.
pub fn read_sequence(caches: &[&crate::KvCache], seq: usize, cal: &Calibration) -> Result<kvforge_kvtc::KvDump> {
    if caches.len() != cal.layers {
        return Err(RtError::ShapeMismatch { what: "kvtc save: caches".into(), expected: format!("{} (one per calibrated layer)", cal.layers), got: caches.len().to_string() });
    }
    let (hkv, d) = (cal.kv_heads, cal.head_dim);
    let mut positions: Option<Vec<i64>> = None;
    let mut rows: Vec<(Vec<f32>, Vec<f32>)> = Vec::with_capacity(cal.layers * hkv);
    for (l, c) in caches.iter().enumerate() {
        if (c.cfg.num_kv_heads, c.cfg.head_dim) != (hkv, d) {
            return Err(RtError::ShapeMismatch { what: format!("kvtc save: layer {l}"), expected: format!("{hkv} kv heads × head_dim {d}"), got: format!("{} × {}", c.cfg.num_kv_heads, c.cfg.head_dim) });
        }
        let basis = c.spec.basis();
        for h in 0..hkv {
            let (mut k, mut v, mut pos) = (Vec::new(), Vec::new(), Vec::new());
            for (page, len, first) in c.positioned_pages(seq, h)? {
                let bytes = c.download_page(page)?;
                let bad = |e: kvforge_ref::PageError| RtError::BadInput(format!("kvtc save: layer {l} head {h} page at token {first}: {e}"));
                let tier = kvforge_ref::page_tier(&c.spec, &bytes).map_err(bad)?;
                let scales = c.radius_scales(tier.id)?.unwrap_or_default();
                let per = scales.len() / hkv;
                let page = kvforge_ref::decode_page(tier, d, &c.spec.page, &bytes, &scales[h * per..(h + 1) * per]).map_err(bad)?;
                let (mut pk, mut pv) = (page.k, page.v);
                basis.to_natural(d, &mut pk);
                basis.to_natural(d, &mut pv);
                k.extend(pk.iter().map(|&x| x as f32));
                v.extend(pv.iter().map(|&x| x as f32));
                pos.extend((first..first + len).map(|p| p as i64));
            }
            match &positions {
                None => positions = Some(pos),
                Some(p) if *p == pos => {}
                Some(_) => return Err(RtError::BadInput(format!("kvtc save: layer {l} head {h} holds other tokens of sequence {seq} than layer 0 head 0"))),
            }
            rows.push((k, v));
        }
    }
    let positions = positions.unwrap_or_default();
    let tokens = positions.len();
    let p = cal.features();
    let mut dump = kvforge_kvtc::KvDump { layers: cal.layers, kv_heads: hkv, head_dim: d, tokens, positions, k: vec![0.0; p * tokens], v: vec![0.0; p * tokens] };
    for (i, (k, v)) in rows.into_iter().enumerate() {
        // [layer][head][token][channel]: head i's rows are one contiguous block
        dump.k[i * tokens * d..(i + 1) * tokens * d].copy_from_slice(&k);
        dump.v[i * tokens * d..(i + 1) * tokens * d].copy_from_slice(&v);
    }
    Ok(dump)
}

/// Reads a container packed with `cal`, restores it on the device with `restorer` and appends it
/// to a new sequence of every layer's cache in `tier` ([`load_sequence`]); returns the sequence
/// ids. Truncated, corrupted or mismatched input fails before anything reaches a cache.
pub fn load_container(caches: &mut [&mut crate::KvCache], input: &mut impl std::io::Read, cal: &Calibration, restorer: &KvtcRestorer, tier: kvforge_spec::TierId) -> Result<Vec<usize>> {
    let dc = kvforge_kvtc::decode_container(input, cal)?;
    let kv = restorer.restore(&dc)?;
    load_sequence(caches, &kv, tier)
}
