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
use kvforge_kvtc::calib::SideCalib;
use kvforge_kvtc::restore::{device_layout, group_table, DeviceLayout, GroupDesc, BN};
use kvforge_kvtc::{Calibration, DecodedContainer, Side};

use crate::device::Device;
use crate::error::{drv, Result, RtError};

/// Most coded tokens one dequant + restore launch pair covers (bounds the coefficient buffer to
/// `MAX_BATCH_TOKENS × components` fp16).
pub const MAX_BATCH_TOKENS: usize = 32768;

/// Tokens per segment of the pipelined restore [`load_container`] runs.
pub const LOAD_SEGMENT_TOKENS: usize = 16384;

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
    kdim: i32,
    p: i32,
    feat0: i32,
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
    /// The blocks' bases back to back, block `b` `[blocks[b].rows][its features]` fp16, rows =
    /// the largest allocation's columns of the block (zero past the calibration's components).
    basis: CudaSlice<u16>,
    blocks: Vec<BlockDev>,
    mean: CudaSlice<f32>,
    /// The side's blocks and allocations (no basis): what [`device_layout`] and [`group_table`] read.
    shape: SideCalib,
}

/// One basis block on the device.
struct BlockDev {
    /// Where its rows start in [`SideDev::basis`] (elements).
    offset: usize,
    rows: usize,
    feat0: usize,
    features: usize,
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
            let shape = SideCalib { mean: Vec::new(), basis: Vec::new(), variance: Vec::new(), allocations: s.allocations.clone(), blocks: s.blocks.clone(), scale: Vec::new() };
            let layouts: Vec<DeviceLayout> = s.allocations.iter().map(|a| device_layout(s, a)).collect();
            let mut blocks = Vec::with_capacity(s.blocks.len());
            let mut host: Vec<u16> = Vec::new();
            for (bi, b) in s.blocks.iter().enumerate() {
                let rows = layouts.iter().map(|l| l.cols[bi].1).max().unwrap_or(0);
                let w = b.features.len();
                let offset = host.len();
                host.resize(offset + rows * w, 0);
                let have = rows.min(b.components.len());
                let o = s.block_offset(bi);
                host[offset..offset + have * w].copy_from_slice(&to_f16_bits(&s.basis[o..o + have * w]));
                blocks.push(BlockDev { offset, rows, feat0: b.features.start, features: w });
            }
            host.resize(host.len().max(1), 0);
            Ok(SideDev { basis: st.clone_htod(&host).map_err(drv("kvtc basis upload"))?, blocks, mean: st.clone_htod(&s.mean).map_err(drv("kvtc mean upload"))?, shape })
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
        self.upload_kept(KeptRows { tokens, kept: &dc.kept, kept_fp16: &dc.kept_fp16 }, &mut k, &mut v)?;
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

    /// Restores a container read with [`kvforge_kvtc::read_container`] (coded chunks still
    /// entropy-coded) in a pipeline of segments of about `segment_tokens` tokens: the host
    /// entropy-decodes segment `i + 1` (all rayon threads) straight into one of two pinned
    /// buffers while a copy stream uploads segment `i` and the restorer's stream runs segment
    /// `i − 1`'s kernels, so the load takes about its slowest stage rather than their sum.
    /// Synchronises both streams; the result is the same as [`KvtcRestorer::restore`]'s.
    pub fn restore_pipelined(&self, sc: &kvforge_kvtc::StoredContainer, segment_tokens: usize) -> Result<(RestoredKv, PipelineTimes)> {
        use rayon::prelude::*;
        if sc.header.calibration != self.calibration {
            return Err(RtError::BadInput("kvtc restore: the container was read with another calibration than this restorer's".into()));
        }
        let (tokens, width, layers) = (sc.tokens(), self.kv_heads * self.head_dim, self.layers);
        let st = &self.st;
        let t_setup = std::time::Instant::now();
        let cs = self.ctx.new_stream().map_err(drv("kvtc copy stream"))?;
        // SAFETY: fully written below: kept tokens by copies, coded tokens by the restore kernel.
        let mut k = unsafe { st.alloc::<u16>((layers * tokens * width).max(1)) }.map_err(drv("kvtc restored keys"))?;
        // SAFETY: as above.
        let mut v = unsafe { st.alloc::<u16>((layers * tokens * width).max(1)) }.map_err(drv("kvtc restored values"))?;
        self.upload_kept(KeptRows { tokens, kept: &sc.kept, kept_fp16: &sc.kept_fp16 }, &mut k, &mut v)?;
        let positions = st.clone_htod(&sc.positions).map_err(drv("kvtc positions"))?;
        // segments: runs of whole (keys, values) chunk pairs; within one, keys' chunks first
        let mut segs: Vec<std::ops::Range<usize>> = Vec::new();
        let mut i = 0;
        while i < sc.chunks.len() {
            let (start, mut n) = (i, 0);
            while i < sc.chunks.len() && (n < segment_tokens.max(1) || i == start) {
                n += sc.chunks[i].tokens.len();
                i += 2;
            }
            segs.push(start..i.min(sc.chunks.len()));
        }
        let order = |r: &std::ops::Range<usize>| -> Vec<usize> { r.clone().step_by(2).chain(r.clone().skip(1).step_by(2)).collect() };
        let bytes_of = |r: &std::ops::Range<usize>| -> usize { r.clone().map(|j| sc.chunks[j].chunk.raw_len as usize).sum() };
        let slab = segs.iter().map(bytes_of).max().unwrap_or(0).max(1);
        let sides = [Side::Keys, Side::Values];
        let allocs = [sc.k_alloc, sc.v_alloc];
        let mut layouts = Vec::with_capacity(2);
        for (s, &ai) in sides.iter().zip(&allocs) {
            let sd = &self.sides[*s as usize];
            let a = sd.shape.allocations.get(ai).ok_or_else(|| RtError::BadInput(format!("kvtc: allocation {ai} not in the calibration")))?;
            layouts.push(device_layout(&sd.shape, a));
        }
        let max_rows = segs.iter().map(|r| r.clone().step_by(2).map(|j| sc.chunks[j].tokens.len()).sum::<usize>()).max().unwrap_or(0);
        // SAFETY: written by the dequant kernel before each restore reads it.
        let mut coeff = unsafe { st.alloc::<u16>((max_rows * layouts.iter().map(|l| l.ldc).max().unwrap_or(0)).max(1)) }.map_err(drv("kvtc coefficients"))?;
        // group tables per (side, chunk tokens), uploaded once
        let mut tables: std::collections::HashMap<(usize, usize), (CudaSlice<GroupRaw>, usize)> = std::collections::HashMap::new();
        for r in sc.chunks.iter().map(|c| &c.tokens) {
            for (si, s) in sides.iter().enumerate() {
                if let std::collections::hash_map::Entry::Vacant(e) = tables.entry((si, r.len())) {
                    let sd = &self.sides[*s as usize];
                    let t: Vec<GroupRaw> = group_table(&sd.shape, &sd.shape.allocations[allocs[si]], &layouts[si], r.len()).into_iter().map(GroupRaw::from).collect();
                    e.insert((st.clone_htod(&t).map_err(drv("kvtc group table"))?, t.len()));
                }
            }
        }
        // SAFETY: pinned staging, written by the host before each copy reads it.
        let mut pinned =
            [unsafe { self.ctx.alloc_pinned_with_flags::<u8>(slab, 0) }.map_err(drv("kvtc pinned staging"))?, unsafe { self.ctx.alloc_pinned_with_flags::<u8>(slab, 0) }.map_err(drv("kvtc pinned staging"))?];
        // SAFETY: written by the copies before the kernels read it.
        let mut dev = [unsafe { st.alloc::<u8>(slab) }.map_err(drv("kvtc packed segment"))?, unsafe { st.alloc::<u8>(slab) }.map_err(drv("kvtc packed segment"))?];
        st.synchronize().map_err(drv("kvtc restore setup"))?;
        let ev = || self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"));
        let (copied, consumed) = ([ev()?, ev()?], [ev()?, ev()?]);
        let mut marks: Vec<[cudarc::driver::CudaEvent; 4]> = Vec::with_capacity(segs.len());
        let mut times = PipelineTimes { segments: segs.len(), setup_ms: t_setup.elapsed().as_secs_f64() * 1e3, ..Default::default() };
        let t_start = std::time::Instant::now();
        for (si, seg) in segs.iter().enumerate() {
            let slot = si % 2;
            let ord = order(seg);
            let bytes = bytes_of(seg);
            // entropy decode into the pinned slot, once the copy that last read it has run: the
            // device's context does not track events (`Device::open`), so `as_mut_slice` does
            // not wait for it; `copied[slot]` was recorded behind that copy (not yet recorded for
            // the first two segments: no wait)
            copied[slot].synchronize().map_err(drv("kvtc pinned staging"))?;
            let td = std::time::Instant::now();
            {
                let buf = pinned[slot].as_mut_slice().map_err(drv("kvtc pinned staging"))?;
                let mut parts: Vec<(usize, &mut [u8])> = Vec::with_capacity(ord.len());
                let mut rest = &mut buf[..bytes];
                for &j in &ord {
                    let (a, b) = rest.split_at_mut(sc.chunks[j].chunk.raw_len as usize);
                    parts.push((j, a));
                    rest = b;
                }
                // Each chunk decodes straight into its part of the pinned slot: no buffer per
                // chunk to allocate, fault in and copy from.
                parts.into_par_iter().try_for_each(|(j, out)| -> Result<()> { Ok(sc.decode_chunk_into(j, out)?) })?;
            }
            times.decode_ms += td.elapsed().as_secs_f64() * 1e3;
            let m = [ev()?, ev()?, ev()?, ev()?];
            if si >= 2 {
                cs.wait(&consumed[slot]).map_err(drv("kvtc copy wait"))?;
            }
            m[0].record(&cs).map_err(drv("event"))?;
            cs.memcpy_htod(&pinned[slot], &mut dev[slot]).map_err(drv("kvtc segment upload"))?;
            m[1].record(&cs).map_err(drv("event"))?;
            copied[slot].record(&cs).map_err(drv("event"))?;
            times.copied_bytes += slab;
            st.wait(&copied[slot]).map_err(drv("kvtc restore wait"))?;
            m[2].record(st).map_err(drv("event"))?;
            let base = dev[slot].device_ptr(st).0;
            let mut off = 0usize;
            for (s_i, side) in sides.iter().enumerate() {
                let list: Vec<usize> = seg.clone().skip(s_i).step_by(2).collect();
                let mut a = 0;
                while a < list.len() {
                    let n = sc.chunks[list[a]].tokens.len();
                    let mut b = a;
                    while b < list.len() && sc.chunks[list[b]].tokens.len() == n {
                        b += 1;
                    }
                    let chunk_bytes = sc.chunks[list[a]].chunk.raw_len as usize;
                    let (gt, ng) = &tables[&(s_i, n)];
                    let br = BatchRef {
                        packed: base + off as u64,
                        groups: gt.device_ptr(st).0,
                        n_groups: *ng,
                        chunks: b - a,
                        n,
                        chunk_bytes,
                        layout: &layouts[s_i],
                        rows: (b - a) * n,
                        first: sc.chunks[list[a]].tokens.start,
                    };
                    let out = if *side == Side::Keys { &mut k } else { &mut v };
                    self.launch_raw(*side, &br, &positions, &mut coeff, out, tokens)?;
                    times.coded_output_bytes += 2 * br.rows * self.features();
                    off += (b - a) * chunk_bytes;
                    a = b;
                }
            }
            m[3].record(st).map_err(drv("event"))?;
            consumed[slot].record(st).map_err(drv("event"))?;
            marks.push(m);
        }
        st.synchronize().map_err(drv("kvtc restore"))?;
        cs.synchronize().map_err(drv("kvtc restore"))?;
        times.wall_ms = t_start.elapsed().as_secs_f64() * 1e3;
        for m in &marks {
            times.copy_ms += f64::from(m[0].elapsed_ms(&m[1]).map_err(drv("event"))?);
            times.kernels_ms += f64::from(m[2].elapsed_ms(&m[3]).map_err(drv("event"))?);
        }
        Ok((RestoredKv { k, v, tokens, layers, width }, times))
    }

    /// Copies the kept tokens' fp16 rows into their places.
    fn upload_kept(&self, kd: KeptRows, k: &mut CudaSlice<u16>, v: &mut CudaSlice<u16>) -> Result<()> {
        let dc = kd;
        let (tokens, width, d, hkv, nk) = (dc.tokens, self.kv_heads * self.head_dim, self.head_dim, self.kv_heads, dc.kept.len());
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
        let alloc = sd.shape.allocations.get(alloc_idx).ok_or_else(|| RtError::BadInput(format!("kvtc: allocation {alloc_idx} not in the calibration")))?;
        let layout = device_layout(&sd.shape, alloc);
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
            let table: Vec<GroupRaw> = group_table(&sd.shape, alloc, &layout, n).into_iter().map(GroupRaw::from).collect();
            out.push(Batch {
                packed: self.st.clone_htod(&packed).map_err(drv("kvtc packed chunks"))?,
                groups: self.st.clone_htod(&table).map_err(drv("kvtc group table"))?,
                n_groups: table.len(),
                chunks: j - i,
                n,
                chunk_bytes: bytes,
                layout: layout.clone(),
                rows: (j - i) * n,
                first: chunks[i].tokens.start,
            });
            i = j;
        }
        Ok(out)
    }

    /// Dequant + restore of one batch into `out` (`[layer][out_rows][width]`).
    fn launch(&self, side: Side, b: &Batch, positions: &CudaSlice<i64>, out: &mut CudaSlice<u16>, out_rows: usize) -> Result<()> {
        // SAFETY: every element is written by the dequant kernel (the group table covers 0..ldc).
        let mut coeff = unsafe { self.st.alloc::<u16>(b.rows * b.layout.ldc) }.map_err(drv("kvtc coefficients"))?;
        let packed = b.packed.device_ptr(&self.st).0;
        let groups = b.groups.device_ptr(&self.st).0;
        self.launch_raw(
            side,
            &BatchRef { packed, groups, n_groups: b.n_groups, chunks: b.chunks, n: b.n, chunk_bytes: b.chunk_bytes, layout: &b.layout, rows: b.rows, first: b.first },
            positions,
            &mut coeff,
            out,
            out_rows,
        )
    }

    /// Dequant of one batch into `coeff` (at least `rows × ldc`), then one restore launch per
    /// basis block, on the restorer's stream.
    fn launch_raw(&self, side: Side, b: &BatchRef, positions: &CudaSlice<i64>, coeff: &mut CudaSlice<u16>, out: &mut CudaSlice<u16>, out_rows: usize) -> Result<()> {
        let st = &self.st;
        let sd = &self.sides[side as usize];
        let ldc = b.layout.ldc;
        if coeff.len() < b.rows * ldc {
            return Err(RtError::BadInput(format!("kvtc: coefficient buffer of {} for {} × {ldc}", coeff.len(), b.rows)));
        }
        let coeff_ptr = coeff.device_ptr(st).0;
        let dp = DequantParams { packed: b.packed, groups: b.groups, coeff: coeff_ptr, chunks: b.chunks as i32, n: b.n as i32, chunk_bytes: b.chunk_bytes as u32, n_groups: b.n_groups as i32, ldc: ldc as i32 };
        let threads = kvforge_gen::KVTC_DEQUANT_THREADS;
        // SAFETY: DequantParams mirrors the device struct; packed holds chunks × chunk_bytes, the
        // group table n_groups entries covering 0..ldc, coeff rows × ldc.
        unsafe { st.launch_builder(&self.dequant).arg(&dp).launch(LaunchConfig { grid_dim: (b.n_groups as u32, b.chunks as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }) }
            .map_err(drv("launch kvtc dequant"))?;
        let rope = side == Side::Keys && self.rope_dim > 0;
        let (basis, mean, out_ptr) = (sd.basis.device_ptr(st).0, sd.mean.device_ptr(st).0, out.device_ptr(st).0);
        for (blk, &(col0, kdim)) in sd.blocks.iter().zip(&b.layout.cols) {
            if kdim > blk.rows {
                return Err(RtError::BadInput(format!("kvtc: allocation needs {kdim} basis rows of a block, {} uploaded", blk.rows)));
            }
            let rp = RestoreParams {
                coeff: coeff_ptr + 2 * col0 as u64,
                basis: basis + 2 * blk.offset as u64,
                mean: mean + 4 * blk.feat0 as u64,
                inv_freq: self.inv_freq.device_ptr(st).0,
                positions: positions.device_ptr(st).0 + 8 * b.first as u64,
                out: out_ptr,
                rows: b.rows as i32,
                ldc: ldc as i32,
                kdim: kdim as i32,
                p: blk.features as i32,
                feat0: blk.feat0 as i32,
                layer_width: (self.kv_heads * self.head_dim) as i32,
                head_dim: self.head_dim as i32,
                rope_dim: if rope { self.rope_dim as i32 } else { 0 },
                out_rows: out_rows as i32,
                out_row0: b.first as i32,
            };
            let grid = b.rows.div_ceil(128) * blk.features.div_ceil(BN);
            // SAFETY: RestoreParams mirrors the device struct; coeff holds rows × ldc with this
            // block's kdim columns from col0, its basis kdim × features (kdim ≤ its rows), the
            // mean its features, out layers × out_rows × width with rows first..first+rows.
            unsafe { st.launch_builder(&self.restore).arg(&rp).launch(LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }.map_err(drv("launch kvtc restore"))?;
        }
        Ok(())
    }
}

/// The kept (sink and window) tokens of a container.
struct KeptRows<'a> {
    tokens: usize,
    kept: &'a [usize],
    kept_fp16: &'a [u16],
}

/// Times of a pipelined restore ([`KvtcRestorer::restore_pipelined`]).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PipelineTimes {
    /// Host wall clock from the first entropy decode to the last kernel done: the load's time
    /// after reading the container's bytes.
    pub wall_ms: f64,
    /// Host wall clock before the pipeline starts: output and staging allocations (device and
    /// pinned), the kept rows' upload, the group tables.
    pub setup_ms: f64,
    /// Host time spent entropy-decoding segments into pinned buffers (all rayon threads at once).
    pub decode_ms: f64,
    /// Device time of the host-to-device copies of the segments (copy stream), summed.
    pub copy_ms: f64,
    /// Device time of the dequant and restore kernels (compute stream), summed.
    pub kernels_ms: f64,
    /// Bytes copied to the device (packed chunks).
    pub copied_bytes: usize,
    pub segments: usize,
    /// fp16 bytes of the coded tokens written by the kernels (both sides).
    pub coded_output_bytes: usize,
}

/// A batch's launch geometry with raw device pointers (its packed chunks and group table).
struct BatchRef<'a> {
    packed: u64,
    groups: u64,
    n_groups: usize,
    chunks: usize,
    n: usize,
    chunk_bytes: usize,
    layout: &'a DeviceLayout,
    rows: usize,
    first: usize,
}

/// One launch pair's input on the device: equal-size consecutive chunks of one side.
struct Batch {
    packed: CudaSlice<u8>,
    groups: CudaSlice<GroupRaw>,
    n_groups: usize,
    chunks: usize,
    n: usize,
    chunk_bytes: usize,
    layout: DeviceLayout,
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
/// ids. Truncated, corrupted or mismatched input fails before anything reaches a cache. The
/// restore is [`KvtcRestorer::restore_pipelined`] in segments of [`LOAD_SEGMENT_TOKENS`].
pub fn load_container(caches: &mut [&mut crate::KvCache], input: &mut impl std::io::Read, cal: &Calibration, restorer: &KvtcRestorer, tier: kvforge_spec::TierId) -> Result<Vec<usize>> {
    let sc = kvforge_kvtc::read_container(input, cal)?;
    let (kv, _) = restorer.restore_pipelined(&sc, LOAD_SEGMENT_TOKENS)?;
    load_sequence(caches, &kv, tier)
}
