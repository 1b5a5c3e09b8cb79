//! Pack (project → quantise → pack → entropy-code) and unpack (the reverse, then RoPE
//! re-applied to keys): the f64 CPU reference of kvtc, streaming through [`crate::container`].
//! Chunks are coded and decoded in parallel (rayon); unpacking returns a cache only when every
//! chunk decoded, so a failure never leaves a partly restored cache behind.

use std::io::{Read, Write};

use faer::Mat;
use half::f16;
use rayon::prelude::*;

use crate::alloc::Allocation;
use crate::calib::{features, Calibration, Side, SideCalib};
use crate::container::{read_chunk, write_chunk, Chunk, Expect, Header, Tag, VERSION};
use crate::dump::KvDump;
use crate::entropy::Entropy;
use crate::error::{KvtcError, Result};
use crate::pack;

/// How to pack.
#[derive(Clone, Copy, Debug)]
pub struct PackOptions {
    /// Index into the calibration's ratios (the allocation used for keys and values).
    pub ratio_index: usize,
    pub entropy: Entropy,
    /// Compressed tokens per chunk (the unit of parallelism and of error reporting).
    pub chunk_tokens: usize,
}

/// Sizes of one packed cache, in bytes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackStats {
    pub tokens: usize,
    pub compressed_tokens: usize,
    /// The cache in fp16 (keys and values).
    pub fp16_bytes: usize,
    /// Compressed tokens in fp16.
    pub compressed_fp16_bytes: usize,
    /// Coded chunks before entropy coding.
    pub coded_raw_bytes: usize,
    /// Coded chunks after entropy coding.
    pub coded_stored_bytes: usize,
    /// Kept (sink and window) tokens, after entropy coding.
    pub kept_stored_bytes: usize,
    /// The whole container.
    pub total_bytes: usize,
}

impl PackStats {
    /// fp16 bytes of the compressed tokens over their coded bytes before entropy coding.
    pub fn ratio_before_entropy(&self) -> f64 {
        self.compressed_fp16_bytes as f64 / self.coded_raw_bytes.max(1) as f64
    }
    /// The same after entropy coding.
    pub fn ratio_after_entropy(&self) -> f64 {
        self.compressed_fp16_bytes as f64 / self.coded_stored_bytes.max(1) as f64
    }
    /// The whole cache in fp16 over the whole container (kept tokens, positions, headers included).
    pub fn ratio_total(&self) -> f64 {
        self.fp16_bytes as f64 / self.total_bytes.max(1) as f64
    }
}

/// Token indices kept in fp16: the first `sinks` and the last `window` (all when they overlap),
/// and the range coded in chunks.
pub fn split(tokens: usize, sinks: usize, window: usize) -> (Vec<usize>, std::ops::Range<usize>) {
    if tokens <= sinks + window {
        return ((0..tokens).collect(), 0..0);
    }
    let kept = (0..sinks).chain(tokens - window..tokens).collect();
    (kept, sinks..tokens - window)
}

pub fn chunk_ranges(r: std::ops::Range<usize>, chunk: usize) -> Vec<std::ops::Range<usize>> {
    (r.start..r.end).step_by(chunk.max(1)).map(|a| a..(a + chunk).min(r.end)).collect()
}

fn check_shapes(cal: &Calibration, dump: &KvDump) -> Result<()> {
    if (cal.layers, cal.kv_heads, cal.head_dim) != (dump.layers, dump.kv_heads, dump.head_dim) {
        return Err(KvtcError::BadInput(format!(
            "cache has {} layers × {} kv heads × head_dim {}, the calibration {} × {} × {}",
            dump.layers, dump.kv_heads, dump.head_dim, cal.layers, cal.kv_heads, cal.head_dim
        )));
    }
    Ok(())
}

/// The first `comps` basis rows of a side as a `p × comps` matrix (columns = directions), built
/// once per pack or unpack and shared by every chunk.
pub fn basis_matrix(s: &SideCalib, p: usize, comps: usize) -> Mat<f64> {
    let mut m = Mat::<f64>::zeros(p, comps);
    for c in 0..comps {
        let (f0, row) = s.basis_row(c);
        for (j, &b) in row.iter().enumerate() {
            m[(f0 + j, c)] = b as f64;
        }
    }
    m
}

/// Decorrelated coordinates of tokens `r` of one side: `(x - mean) ⊙ s² · bt` (`s²` of a
/// weighted calibration, [`SideCalib::project_scale`]; 1 otherwise), `n × comps`, where
/// `bt` is [`basis_matrix`] of that side.
pub fn project(dump: &KvDump, cal: &Calibration, side: Side, r: std::ops::Range<usize>, bt: &Mat<f64>) -> Vec<f64> {
    let s = cal.side(side);
    let p = cal.features();
    let comps = bt.ncols();
    let n = r.len();
    let mut x = Mat::<f64>::zeros(n, p);
    let mut row = vec![0.0; p];
    let sq = s.project_scale();
    for (i, t) in r.enumerate() {
        features(dump, side, t, cal.rope, &mut row);
        for f in 0..p {
            x[(i, f)] = (row[f] - s.mean[f] as f64) * sq.as_ref().map_or(1.0, |q| q[f]);
        }
    }
    let d = &x * bt;
    (0..n).flat_map(|i| (0..comps).map(move |c| (i, c))).map(|(i, c)| d[(i, c)]).collect()
}

/// Features of `n` tokens from decorrelated coordinates: `d · btᵀ + mean`, `n × p`.
pub fn reconstruct(s: &SideCalib, d: &[f64], n: usize, bt: &Mat<f64>) -> Vec<f64> {
    let (p, comps) = (bt.nrows(), bt.ncols());
    let dm = Mat::<f64>::from_fn(n, comps, |i, c| d[i * comps + c]);
    let x = &dm * bt.transpose();
    (0..n).flat_map(|i| (0..p).map(move |f| (i, f))).map(|(i, f)| x[(i, f)] + s.mean[f] as f64).collect()
}

fn alloc_for(cal: &Calibration, side: Side, idx: usize) -> &Allocation {
    &cal.side(side).allocations[idx]
}

/// Compresses `dump` with `cal` into `out`.
pub fn pack_into(dump: &KvDump, cal: &Calibration, opts: &PackOptions, out: &mut impl Write) -> Result<PackStats> {
    dump.validate()?;
    check_shapes(cal, dump)?;
    if opts.ratio_index >= cal.ratios.len() {
        return Err(KvtcError::BadInput(format!("ratio index {} out of {} calibrated ratios", opts.ratio_index, cal.ratios.len())));
    }
    if dump.tokens > u32::MAX as usize / 2 || opts.chunk_tokens == 0 {
        return Err(KvtcError::BadInput("token count or chunk size out of range".into()));
    }
    let (ka, va) = (alloc_for(cal, Side::Keys, opts.ratio_index), alloc_for(cal, Side::Values, opts.ratio_index));
    if opts.entropy == Entropy::Rans && !(ka.codable() && va.codable()) {
        return Err(KvtcError::BadInput(format!("entropy `rans` needs a calibration with code models (`kvforge calibrate --step` or `--coded`); calibration {} has no code models", cal.id_hex())));
    }
    let header = Header {
        version: VERSION,
        entropy: opts.entropy.id(),
        calibration: cal.id(),
        layers: dump.layers as u32,
        kv_heads: dump.kv_heads as u32,
        head_dim: dump.head_dim as u32,
        tokens: dump.tokens as u32,
        sinks: cal.sinks as u32,
        window: cal.window as u32,
        chunk_tokens: opts.chunk_tokens as u32,
        k_budget_bits: ka.budget_bits,
        v_budget_bits: va.budget_bits,
    };
    let mut stats = PackStats { tokens: dump.tokens, fp16_bytes: 4 * dump.features() * dump.tokens, ..Default::default() };
    let mut total = 0usize;
    let hb = header.to_bytes();
    out.write_all(&hb)?;
    total += hb.len();
    let mut index = 0u32;
    let mut emit = |out: &mut dyn Write, tag: Tag, first: usize, count: usize, raw: &[u8], (stored, stored_raw): (Vec<u8>, bool), total: &mut usize| -> Result<usize> {
        let c = Chunk { tag, index, first: first as u32, count: count as u32, raw_len: raw.len() as u32, stored_raw, payload: stored };
        let mut w = out;
        write_chunk(&mut w, &c)?;
        index += 1;
        *total += crate::container::CHUNK_HEADER_LEN + c.payload.len();
        Ok(c.payload.len())
    };
    let pos: Vec<u8> = dump.positions.iter().flat_map(|p| p.to_le_bytes()).collect();
    emit(out, Tag::Positions, 0, dump.tokens, &pos, opts.entropy.code(&pos), &mut total)?;
    let (kept, coded) = split(dump.tokens, cal.sinks, cal.window);
    let mut kb = Vec::with_capacity(4 * dump.features() * kept.len());
    for src in [&dump.k, &dump.v] {
        for l in 0..dump.layers {
            for h in 0..dump.kv_heads {
                for &t in &kept {
                    let a = dump.at(l, h, t, 0);
                    kb.extend(src[a..a + dump.head_dim].iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()));
                }
            }
        }
    }
    stats.kept_stored_bytes = emit(out, Tag::Kept, 0, kept.len(), &kb, opts.entropy.code(&kb), &mut total)?;
    stats.compressed_tokens = coded.len();
    stats.compressed_fp16_bytes = 4 * dump.features() * coded.len();
    let ranges = chunk_ranges(coded, opts.chunk_tokens);
    let p = cal.features();
    let (kbasis, vbasis) = (basis_matrix(&cal.k, p, ka.used_components()), basis_matrix(&cal.v, p, va.used_components()));
    // Code chunks in parallel, a bounded batch at a time, and write them in order.
    for batch in ranges.chunks(rayon::current_num_threads().max(1) * 2) {
        let coded = batch
            .par_iter()
            .map(|r| {
                let [k, v] = [(Side::Keys, ka, &kbasis), (Side::Values, va, &vbasis)].map(|(side, a, bt)| {
                    let comps = a.used_components();
                    let d = project(dump, cal, side, r.clone(), bt);
                    let raw = pack::encode(&d, r.len(), comps, a);
                    opts.entropy.code_chunk(&raw, r.len(), Some(a)).map(|stored| (raw, stored)).map_err(KvtcError::BadInput)
                });
                Ok([k?, v?])
            })
            .collect::<Result<Vec<_>>>()?;
        for (r, [(kr, ks), (vr, vs)]) in batch.iter().zip(coded) {
            stats.coded_raw_bytes += kr.len() + vr.len();
            stats.coded_stored_bytes += emit(out, Tag::Keys, r.start, r.len(), &kr, ks, &mut total)?;
            stats.coded_stored_bytes += emit(out, Tag::Values, r.start, r.len(), &vr, vs, &mut total)?;
        }
    }
    emit(out, Tag::End, 0, 0, &[], (Vec::new(), false), &mut total)?;
    stats.total_bytes = total;
    Ok(stats)
}

/// The coder that decodes chunk `c` of a container coded with `entropy`.
fn coder(entropy: Entropy, c: &Chunk) -> Entropy {
    if c.stored_raw {
        Entropy::None
    } else {
        entropy
    }
}

/// Largest stored size accepted for a chunk of `raw` bytes (DEFLATE / zstd worst case).
fn max_stored(raw: usize) -> u32 {
    (raw + raw / 8 + 1024).min(u32::MAX as usize) as u32
}

/// One coded chunk of a container after entropy decoding: the packed bytes of `tokens` of one
/// side ([`crate::pack`] layout), what the GPU restore uploads.
#[derive(Clone, Debug)]
pub struct DecodedChunk {
    /// Stream index of the chunk (what errors name).
    pub index: u32,
    pub side: Side,
    pub tokens: std::ops::Range<usize>,
    pub raw: Vec<u8>,
}

/// One coded chunk of a container as stored (checked, still entropy-coded).
#[derive(Clone, Debug)]
pub struct StoredChunk {
    pub side: Side,
    pub tokens: std::ops::Range<usize>,
    pub chunk: Chunk,
}

/// A container read and checked (header, checksums, order, sizes), its small chunks
/// (positions, kept tokens) decoded; its coded chunks are `C`: [`StoredChunk`] still
/// entropy-coded ([`StoredContainer`], the input of a restore that decodes chunks while earlier
/// ones are uploaded and restored, kvforge-rt `KvtcRestorer::restore_pipelined`) or
/// [`DecodedChunk`] ([`DecodedContainer`], the common front of the CPU [`unpack_from`] and the
/// GPU restore).
#[derive(Clone, Debug)]
pub struct Container<C> {
    pub header: Header,
    /// Allocation indices of keys and values in the calibration.
    pub k_alloc: usize,
    pub v_alloc: usize,
    pub positions: Vec<i64>,
    /// Token indices kept in fp16 (sinks, then the recent window).
    pub kept: Vec<usize>,
    /// Kept tokens' fp16 bits, keys `[layer][head][kept][channel]` then values.
    pub kept_fp16: Vec<u16>,
    /// Tokens coded in chunks.
    pub coded: std::ops::Range<usize>,
    /// Coded chunks in stream order (per token run: keys, then values).
    pub chunks: Vec<C>,
    /// The key and value allocations the chunks were packed with (the `rans` coder's models);
    /// None for a container built without a calibration (chunks then byte-coded only).
    pub allocs: Option<std::sync::Arc<[Allocation; 2]>>,
}

/// A container with its coded chunks entropy-decoded.
pub type DecodedContainer = Container<DecodedChunk>;
/// A container with its coded chunks still entropy-coded.
pub type StoredContainer = Container<StoredChunk>;

impl<C> Container<C> {
    pub fn tokens(&self) -> usize {
        self.header.tokens as usize
    }

    /// The allocation `side`'s chunks were packed with, where the container knows it.
    pub fn alloc_of(&self, side: Side) -> Option<&Allocation> {
        self.allocs.as_ref().map(|a| &a[usize::from(side == Side::Values)])
    }
}

impl StoredContainer {
    /// The entropy coder the header names.
    pub fn entropy(&self) -> Result<Entropy> {
        Entropy::from_id(self.header.entropy).ok_or_else(|| KvtcError::BadChunk { chunk: 0, message: format!("unknown entropy coder {}", self.header.entropy) })
    }

    /// Entropy-decodes coded chunk `i` (of [`Container::chunks`]).
    pub fn decode_chunk(&self, i: usize) -> Result<DecodedChunk> {
        let StoredChunk { side, tokens, chunk: c } = &self.chunks[i];
        let mut raw = vec![0u8; c.raw_len as usize];
        self.decode_chunk_into(i, &mut raw)?;
        Ok(DecodedChunk { index: c.index, side: *side, tokens: tokens.clone(), raw })
    }

    /// Entropy-decodes coded chunk `i` into `out`, which must be exactly its `raw_len` bytes.
    pub fn decode_chunk_into(&self, i: usize, out: &mut [u8]) -> Result<()> {
        let c = &self.chunks[i].chunk;
        if out.len() != c.raw_len as usize {
            return Err(KvtcError::BadChunk { chunk: c.index, message: format!("{} output bytes for a chunk of {}", out.len(), c.raw_len) });
        }
        coder(self.entropy()?, c).decompress_chunk_into(&c.payload, c.count as usize, self.alloc_of(self.chunks[i].side), out).map_err(|message| KvtcError::Entropy { chunk: c.index, message })
    }

    /// Entropy-decodes every coded chunk on all rayon threads.
    pub fn decode(self) -> Result<DecodedContainer> {
        let chunks = (0..self.chunks.len()).into_par_iter().map(|i| self.decode_chunk(i)).collect::<Result<Vec<_>>>()?;
        Ok(Container { header: self.header, k_alloc: self.k_alloc, v_alloc: self.v_alloc, positions: self.positions, kept: self.kept, kept_fp16: self.kept_fp16, coded: self.coded, chunks, allocs: self.allocs })
    }
}

/// Reads every chunk of a container packed with `cal` (checksums, order, sizes), decoding the
/// positions and kept tokens and leaving the coded chunks entropy-coded. Fails, naming the
/// chunk, on anything truncated, corrupted or packed with another calibration.
pub fn read_container(input: &mut impl Read, cal: &Calibration) -> Result<StoredContainer> {
    let h = Header::read(input)?;
    if h.calibration != cal.id() {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        return Err(KvtcError::CalibrationMismatch { expected: cal.id_hex(), found: hex(&h.calibration) });
    }
    let entropy = Entropy::from_id(h.entropy).ok_or_else(|| KvtcError::BadChunk { chunk: 0, message: format!("unknown entropy coder {}", h.entropy) })?;
    let (layers, kv_heads, head_dim, tokens) = (h.layers as usize, h.kv_heads as usize, h.head_dim as usize, h.tokens as usize);
    if (layers, kv_heads, head_dim) != (cal.layers, cal.kv_heads, cal.head_dim) || (h.sinks as usize, h.window as usize) != (cal.sinks, cal.window) || h.chunk_tokens == 0 {
        return Err(KvtcError::BadChunk { chunk: 0, message: "header shapes disagree with the calibration".into() });
    }
    let find =
        |side: Side, bits: u32| cal.side(side).allocations.iter().position(|a| a.budget_bits == bits).ok_or(KvtcError::UnknownAllocation { calibration: cal.id_hex(), side: side.name(), budget_bits: bits });
    let (k_alloc, v_alloc) = (find(Side::Keys, h.k_budget_bits)?, find(Side::Values, h.v_budget_bits)?);
    let (ka, va) = (alloc_for(cal, Side::Keys, k_alloc), alloc_for(cal, Side::Values, v_alloc));
    let p = cal.features();
    let mut index = 0u32;
    let mut next = |input: &mut dyn Read, tag: Tag, first: usize, count: usize, raw_len: usize| -> Result<Chunk> {
        let e = Expect { tag, index, first: first as u32, count: count as u32, raw_len: raw_len as u32, max_stored: max_stored(raw_len) };
        let mut r = input;
        let c = read_chunk(&mut r, &e)?;
        index += 1;
        Ok(c)
    };
    let decode = |c: &Chunk| coder(entropy, c).decompress(&c.payload, c.raw_len as usize).map_err(|message| KvtcError::Entropy { chunk: c.index, message });
    let c = next(input, Tag::Positions, 0, tokens, 8 * tokens)?;
    let positions: Vec<i64> = decode(&c)?.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
    let (kept, coded) = split(tokens, cal.sinks, cal.window);
    let c = next(input, Tag::Kept, 0, kept.len(), 4 * p * kept.len())?;
    let kept_fp16: Vec<u16> = decode(&c)?.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
    let ranges = chunk_ranges(coded.clone(), h.chunk_tokens as usize);
    let mut chunks = Vec::with_capacity(2 * ranges.len());
    for r in &ranges {
        chunks.push(StoredChunk { side: Side::Keys, tokens: r.clone(), chunk: next(input, Tag::Keys, r.start, r.len(), pack::raw_len(r.len(), ka))? });
        chunks.push(StoredChunk { side: Side::Values, tokens: r.clone(), chunk: next(input, Tag::Values, r.start, r.len(), pack::raw_len(r.len(), va))? });
    }
    next(input, Tag::End, 0, 0, 0)?;
    let allocs = Some(std::sync::Arc::new([ka.clone(), va.clone()]));
    Ok(Container { header: h, k_alloc, v_alloc, positions, kept, kept_fp16, coded, chunks, allocs })
}

/// Reads every chunk of a container packed with `cal` (checksums, order, sizes), then
/// entropy-decodes the chunks on all rayon threads. Fails, naming the chunk, on anything
/// truncated, corrupted or packed with another calibration.
pub fn decode_container(input: &mut impl Read, cal: &Calibration) -> Result<DecodedContainer> {
    read_container(input, cal)?.decode()
}

/// Writes a container from already packed chunks (`dc`, e.g. a restore benchmark's synthetic
/// one), entropy-coding them with `entropy` on all rayon threads; returns the bytes written.
pub fn write_container(dc: &DecodedContainer, entropy: Entropy, out: &mut impl Write) -> Result<usize> {
    let header = Header { entropy: entropy.id(), ..dc.header.clone() };
    let hb = header.to_bytes();
    out.write_all(&hb)?;
    let mut total = hb.len();
    let mut emit = |out: &mut dyn Write, c: Chunk| -> Result<()> {
        let mut w = out;
        total += crate::container::CHUNK_HEADER_LEN + c.payload.len();
        write_chunk(&mut w, &c)
    };
    let pos: Vec<u8> = dc.positions.iter().flat_map(|p| p.to_le_bytes()).collect();
    let (payload, stored_raw) = entropy.code(&pos);
    emit(out, Chunk { tag: Tag::Positions, index: 0, first: 0, count: dc.tokens() as u32, raw_len: pos.len() as u32, stored_raw, payload })?;
    let kb: Vec<u8> = dc.kept_fp16.iter().flat_map(|x| x.to_le_bytes()).collect();
    let (payload, stored_raw) = entropy.code(&kb);
    emit(out, Chunk { tag: Tag::Kept, index: 1, first: 0, count: dc.kept.len() as u32, raw_len: kb.len() as u32, stored_raw, payload })?;
    let stored: Vec<(Vec<u8>, bool)> = dc.chunks.par_iter().map(|c| entropy.code_chunk(&c.raw, c.tokens.len(), dc.alloc_of(c.side)).map_err(KvtcError::BadInput)).collect::<Result<_>>()?;
    for (c, (payload, stored_raw)) in dc.chunks.iter().zip(stored) {
        let tag = if c.side == Side::Keys { Tag::Keys } else { Tag::Values };
        emit(out, Chunk { tag, index: c.index, first: c.tokens.start as u32, count: c.tokens.len() as u32, raw_len: c.raw.len() as u32, stored_raw, payload })?;
    }
    emit(out, Chunk { tag: Tag::End, index: 2 + dc.chunks.len() as u32, first: 0, count: 0, raw_len: 0, stored_raw: false, payload: Vec::new() })?;
    Ok(total)
}

/// Restores a cache packed by [`pack_into`] with the same calibration.
pub fn unpack_from(input: &mut impl Read, cal: &Calibration) -> Result<KvDump> {
    let dc = decode_container(input, cal)?;
    let (layers, kv_heads, head_dim, tokens) = (cal.layers, cal.kv_heads, cal.head_dim, dc.tokens());
    let p = cal.features();
    let (ka, va) = (alloc_for(cal, Side::Keys, dc.k_alloc), alloc_for(cal, Side::Values, dc.v_alloc));
    let mut dump = KvDump { layers, kv_heads, head_dim, tokens, positions: dc.positions.clone(), k: vec![0.0; p * tokens], v: vec![0.0; p * tokens] };
    let mut at = 0;
    for s in 0..2 {
        for l in 0..layers {
            for hh in 0..kv_heads {
                for &t in &dc.kept {
                    let a = dump.at(l, hh, t, 0);
                    let dst = if s == 0 { &mut dump.k } else { &mut dump.v };
                    for ch in 0..head_dim {
                        dst[a + ch] = f16::from_bits(dc.kept_fp16[at]).to_f32();
                        at += 1;
                    }
                }
            }
        }
    }
    let (kbm, vbm) = (basis_matrix(&cal.k, p, ka.used_components()), basis_matrix(&cal.v, p, va.used_components()));
    let restored: Vec<Vec<f64>> = dc
        .chunks
        .par_iter()
        .map(|c| {
            let (a, bt) = if c.side == Side::Keys { (ka, &kbm) } else { (va, &vbm) };
            let d = pack::decode(&c.raw, c.tokens.len(), a.used_components(), a);
            reconstruct(cal.side(c.side), &d, c.tokens.len(), bt)
        })
        .collect();
    for (c, x) in dc.chunks.iter().zip(restored) {
        scatter(&mut dump, cal, c.side, c.tokens.clone(), &x);
    }
    Ok(dump)
}

/// Writes restored features of tokens `r` into the dump, re-applying RoPE to keys.
fn scatter(dump: &mut KvDump, cal: &Calibration, side: Side, r: std::ops::Range<usize>, x: &[f64]) {
    let (hd, p) = (dump.head_dim, cal.features());
    let mut row = vec![0.0; hd];
    for (i, t) in r.enumerate() {
        for l in 0..dump.layers {
            for h in 0..dump.kv_heads {
                let o = i * p + (l * dump.kv_heads + h) * hd;
                row.copy_from_slice(&x[o..o + hd]);
                if let (Side::Keys, Some(rope)) = (side, cal.rope) {
                    rope.apply(&mut row, dump.positions[t], 1.0);
                }
                let a = dump.at(l, h, t, 0);
                let dst = if side == Side::Keys { &mut dump.k } else { &mut dump.v };
                for (d, &s) in dst[a..a + hd].iter_mut().zip(&row) {
                    *d = s as f32;
                }
            }
        }
    }
}
