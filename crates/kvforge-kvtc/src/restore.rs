//! What the GPU restore (`templates/include/kvforge/kvtc.cuh`, launched by kvforge-rt `kvtc`)
//! computes, in f64 and in the kernels' order of operations, so the device tests compare
//! against it and a CPU test ties it to [`crate::unpack_from`]:
//!
//! 1. dequant: the allocation as a table of [`GroupDesc`] covering components `0..ldc`
//!    ([`group_table`]; gaps and the padding to a multiple of [`BK`] are zero-bit groups),
//!    every code of a chunk turned into `shift + code · scale`, an `n × ldc` coefficient matrix
//!    ([`dequant_reference`]; the device stores it in fp16).
//! 2. restore: `coefficients · basis + mean` (the device: fp16 operands, fp32 accumulation),
//!    RoPE re-applied to keys at each token's position, rows written per layer:
//!    `out[layer][token][kv_head · head_dim + channel]` ([`restore_reference`]).

use half::f16;

use crate::alloc::Allocation;
use crate::calib::{Calibration, Side, SideCalib};

/// Components per k-tile of the device matmul: coefficient rows and basis rows are padded to
/// a multiple of it.
pub const BK: usize = 32;

/// Column tile of the device matmul: a head must not straddle two tiles (RoPE pairs channels
/// of one head), so `head_dim` must divide it.
pub const BN: usize = 128;

/// Where each basis block's coefficients sit in the device's coefficient matrix for one
/// allocation: block `b` has columns `cols[b].0 .. cols[b].0 + cols[b].1`, its used components
/// (up to its last coded one) rounded up to [`BK`]; `ldc` is their sum, at least one tile. A
/// block with no coded component has no columns (its features are the mean). The restore runs
/// one matmul per block: `2 · tokens · cols[b].1 · features(b)` FLOP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLayout {
    pub ldc: usize,
    pub cols: Vec<(usize, usize)>,
}

impl DeviceLayout {
    /// Multiply-adds per token of the restore's matmuls (times 2 for FLOP).
    pub fn macs_per_token(&self, s: &SideCalib) -> usize {
        s.blocks.iter().zip(&self.cols).map(|(b, c)| c.1 * b.features.len()).sum()
    }
}

/// The [`DeviceLayout`] of `alloc` over `s`'s blocks.
pub fn device_layout(s: &SideCalib, alloc: &Allocation) -> DeviceLayout {
    let mut cols = Vec::with_capacity(s.blocks.len());
    let mut at = 0;
    for b in &s.blocks {
        let used = alloc.groups.iter().filter(|g| b.components.contains(&(g.start as usize))).map(|g| (g.start + g.len) as usize - b.components.start).max().unwrap_or(0);
        let w = used.div_ceil(BK) * BK;
        cols.push((at, w));
        at += w;
    }
    if at == 0 {
        if let Some(c) = cols.first_mut() {
            c.1 = BK;
        }
        at = BK;
    }
    DeviceLayout { ldc: at, cols }
}

/// Coefficient columns the device uses for `alloc` over `s` ([`DeviceLayout::ldc`]).
pub fn padded_components(s: &SideCalib, alloc: &Allocation) -> usize {
    device_layout(s, alloc).ldc
}

/// One group as the dequant kernel reads it (`kvforge::kvtc::GroupDesc`, same field order):
/// device columns `start..start+len`, `bits` per code (0: written as zeros), the group's planes at
/// byte `offset` of a chunk of `n` tokens (fp16 shift/scale pairs, then codes at `offset + 4n`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupDesc {
    pub start: i32,
    pub len: i32,
    pub bits: i32,
    pub offset: u32,
}

/// The allocation's groups for chunks of `n` tokens in the device columns of `layout`
/// ([`device_layout`]), with zero-bit groups filling every column no group codes (the device
/// writes each coefficient exactly once).
pub fn group_table(s: &SideCalib, alloc: &Allocation, layout: &DeviceLayout, n: usize) -> Vec<GroupDesc> {
    let mut out = Vec::with_capacity(2 * alloc.groups.len() + s.blocks.len() + 1);
    let mut offset = 0usize;
    let gap = |out: &mut Vec<GroupDesc>, from: usize, to: usize| {
        // zero-bit groups of at most 1024 components, so no CTA gets a huge one
        let mut a = from;
        while a < to {
            let len = (to - a).min(1024);
            out.push(GroupDesc { start: a as i32, len: len as i32, bits: 0, offset: 0 });
            a += len;
        }
    };
    for (b, &(col0, width)) in s.blocks.iter().zip(&layout.cols) {
        let mut next = col0;
        for g in alloc.groups.iter().filter(|g| b.components.contains(&(g.start as usize))) {
            let (c, len, bits) = (col0 + g.start as usize - b.components.start, g.len as usize, g.bits as usize);
            gap(&mut out, next, c);
            out.push(GroupDesc { start: c as i32, len: len as i32, bits: bits as i32, offset: offset as u32 });
            offset += 4 * n + (n * len * bits).div_ceil(8);
            next = c + len;
        }
        gap(&mut out, next, col0 + width);
    }
    out
}

/// The dequant kernel in f64: `n × ldc` coefficients of a packed chunk (`raw`, [`crate::pack`]
/// layout) through `table` ([`group_table`]).
pub fn dequant_reference(raw: &[u8], n: usize, table: &[GroupDesc], ldc: usize) -> Vec<f64> {
    let mut d = vec![0.0; n * ldc];
    for g in table.iter().filter(|g| g.bits > 0) {
        let (len, bits, base) = (g.len as usize, g.bits as usize, g.offset as usize);
        for t in 0..n {
            let s = &raw[base + 4 * t..base + 4 * t + 4];
            let (lo, scale) = (f16::from_le_bytes([s[0], s[1]]).to_f64(), f16::from_le_bytes([s[2], s[3]]).to_f64());
            for j in 0..len {
                let bit = (t * len + j) * bits;
                let (first, last) = (bit / 8, (bit + bits - 1) / 8);
                let mut w = 0u32;
                for (k, b) in raw[base + 4 * n + first..=base + 4 * n + last].iter().enumerate() {
                    w |= (*b as u32) << (8 * k);
                }
                let code = (w >> (bit % 8)) & ((1u32 << bits) - 1);
                d[t * ldc + g.start as usize + j] = lo + code as f64 * scale;
            }
        }
    }
    d
}

/// `f16` rounding of an f64, as the device rounds its operands.
fn h(x: f64) -> f64 {
    f16::from_f64(x).to_f64()
}

/// The restore kernel in f64: features of `n` tokens from `n × layout.ldc` coefficients (block
/// `b`'s components in its columns of `layout`), the mean added and RoPE applied to keys at
/// `positions`, as `[layer][token][kv_head · head_dim + channel]`. `fp16_operands`: round
/// coefficients and basis to fp16 first, as the device does (off, the result is the CPU
/// unpack's up to summation order).
pub fn restore_reference(cal: &Calibration, side: Side, coeff: &[f64], n: usize, layout: &DeviceLayout, positions: &[i64], fp16_operands: bool) -> Vec<f64> {
    let s = cal.side(side);
    let p = cal.features();
    let ldc = layout.ldc;
    let width = cal.kv_heads * cal.head_dim;
    let round = |x: f64| if fp16_operands { h(x) } else { x };
    let mut out = vec![0.0; n * p];
    let mut x = vec![0.0; p];
    for t in 0..n {
        x.iter_mut().enumerate().for_each(|(f, v)| *v = s.mean[f] as f64);
        for (b, &(col0, w)) in s.blocks.iter().zip(&layout.cols) {
            for j in 0..w.min(b.components.len()) {
                let a = round(coeff[t * ldc + col0 + j]);
                if a == 0.0 {
                    continue;
                }
                let (f0, row) = s.basis_row(b.components.start + j);
                for (v, &r) in x[f0..f0 + row.len()].iter_mut().zip(row) {
                    *v += a * round(r as f64);
                }
            }
        }
        for (head, chunk) in x.chunks_mut(cal.head_dim).enumerate() {
            if let (Side::Keys, Some(r)) = (side, cal.rope) {
                r.apply(chunk, positions[t], 1.0);
            }
            let (l, within) = (head / cal.kv_heads, (head % cal.kv_heads) * cal.head_dim);
            out[(l * n + t) * width + within..][..cal.head_dim].copy_from_slice(chunk);
        }
    }
    out
}

/// A cheap deterministic stream of roughly normal numbers (sum of uniforms), for synthetic data.
fn noise(seed: u64, i: u64) -> f64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut acc = 0.0;
    for _ in 0..4 {
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        acc += (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    }
    acc * 1.7320508
}

/// An allocation for `budget_bits` per token over components `first..first + components`:
/// `singles` single components at 8 bits, then groups of 64 at 4 bits while the budget lasts
/// (the shape of a real 8–64× allocation, not a solved one).
pub fn synthetic_allocation(budget_bits: usize, first: usize, components: usize, singles: usize) -> Allocation {
    let mut groups = Vec::new();
    let (mut used, mut start) = (0usize, 0usize);
    for _ in 0..singles {
        if used + 40 > budget_bits || start >= components {
            break;
        }
        groups.push(crate::alloc::Group::new((first + start) as u32, 1, 8));
        used += 40;
        start += 1;
    }
    while used + 64 * 4 + 32 <= budget_bits && start + 64 <= components {
        groups.push(crate::alloc::Group::new((first + start) as u32, 64, 4));
        used += 64 * 4 + 32;
        start += 64;
    }
    Allocation { budget_bits: budget_bits as u32, groups, expected_error: f64::NAN, models: Vec::new(), step: 0.0, dead_zone: 0.0 }
}

/// A calibration of the right shape with random directions (not orthonormal) and means, and
/// per ratio an allocation of [`synthetic_allocation`]s, one per basis block with an equal share
/// of the budget (16 single components over all, spread over the blocks), for restore
/// throughput and device tests, where only the arithmetic matters. `layers_per_basis`: as
/// [`crate::CalibConfig::layers_per_basis`] (0: one block). Real quality needs [`crate::calibrate`].
pub fn synthetic_calibration(layers: usize, kv_heads: usize, head_dim: usize, rope: Option<crate::Rope>, ratios: &[f64], layers_per_basis: usize, seed: u64) -> Calibration {
    use rayon::prelude::*;
    let p = layers * kv_heads * head_dim;
    let fblocks = crate::calib::block_features(layers, kv_heads * head_dim, layers_per_basis);
    let nb = fblocks.len();
    let multi = nb > 1;
    let cap = |w: usize| if multi { w.div_ceil(crate::calib::BLOCK_ALIGN) * crate::calib::BLOCK_ALIGN } else { w };
    let starts: Vec<usize> = fblocks
        .iter()
        .scan(0, |c, f| {
            let s = *c;
            *c += cap(f.len());
            Some(s)
        })
        .collect();
    let allocs: Vec<Allocation> = ratios
        .iter()
        .map(|&r| {
            let budget = crate::calib::budget_bits(p, r);
            let mut groups = Vec::new();
            for (f, &c0) in fblocks.iter().zip(&starts) {
                let share = budget * f.len() / p;
                groups.extend(synthetic_allocation(share, c0, cap(f.len()), 16usize.div_ceil(nb)).groups);
            }
            Allocation { budget_bits: budget as u32, groups, expected_error: f64::NAN, models: Vec::new(), step: 0.0, dead_zone: 0.0 }
        })
        .collect();
    // one block: kept as far as the largest allocation uses it; several: whole
    let blocks: Vec<crate::calib::BasisBlock> = if multi {
        fblocks.iter().zip(&starts).map(|(f, &c0)| crate::calib::BasisBlock { features: f.clone(), components: c0..c0 + cap(f.len()) }).collect()
    } else {
        let used = allocs.iter().map(Allocation::used_components).max().unwrap_or(0).max(1);
        vec![crate::calib::BasisBlock { features: 0..p, components: 0..used }]
    };
    let c = blocks.last().map_or(0, |b| b.components.end);
    let comps = c;
    let side = |k: u64| {
        let total: usize = blocks.iter().map(|b| b.components.len() * b.features.len()).sum();
        let mut basis = vec![0f32; total];
        let scale = 1.0 / (blocks[0].features.len() as f64).sqrt();
        basis.par_chunks_mut(1 << 16).enumerate().for_each(|(ci, ch)| ch.iter_mut().enumerate().for_each(|(i, b)| *b = (noise(seed + k, (ci * (1 << 16) + i) as u64) * scale) as f32));
        crate::calib::SideCalib {
            mean: (0..p).map(|f| (0.1 * noise(seed + k + 7, f as u64)) as f32).collect(),
            basis,
            variance: (0..comps).map(|c| 1.0 / (1.0 + c as f32)).collect(),
            allocations: allocs.clone(),
            blocks: blocks.clone(),
            scale: Vec::new(),
        }
    };
    Calibration { layers, kv_heads, head_dim, rope, sinks: 4, window: 128, samples: 0, ratios: ratios.to_vec(), k: side(1), v: side(2) }
}

/// A packed chunk of `n` tokens for `alloc`: random coefficients with variance falling as
/// `1 / (1 + component)`, quantised and packed as [`crate::pack_into`] does.
pub fn synthetic_chunk(alloc: &Allocation, n: usize, seed: u64) -> Vec<u8> {
    let comps = alloc.used_components();
    let d: Vec<f64> = (0..n * comps).map(|i| noise(seed, i as u64) * 8.0 / (1.0 + (i % comps.max(1)) as f64).sqrt()).collect();
    crate::pack::encode(&d, n, comps, alloc)
}

/// A decoded container of `tokens` tokens for `cal` at allocation `ratio_index` (both sides),
/// built without packing: positions `0..tokens`, random fp16 kept rows, and coded chunks of
/// `chunk_tokens` from [`synthetic_chunk`], `distinct` different contents per side repeated
/// (a 128K-token cache costs seconds, not a CPU projection). For restore tests and benches.
pub fn synthetic_container(cal: &Calibration, ratio_index: usize, tokens: usize, chunk_tokens: usize, distinct: usize, seed: u64) -> crate::DecodedContainer {
    use rayon::prelude::*;
    let (ka, va) = (&cal.k.allocations[ratio_index], &cal.v.allocations[ratio_index]);
    let header = crate::container::Header {
        version: crate::container::VERSION,
        entropy: 0,
        calibration: cal.id(),
        layers: cal.layers as u32,
        kv_heads: cal.kv_heads as u32,
        head_dim: cal.head_dim as u32,
        tokens: tokens as u32,
        sinks: cal.sinks as u32,
        window: cal.window as u32,
        chunk_tokens: chunk_tokens as u32,
        k_budget_bits: ka.budget_bits,
        v_budget_bits: va.budget_bits,
    };
    let (kept, coded) = crate::codec::split(tokens, cal.sinks, cal.window);
    let kept_fp16 = (0..2 * cal.features() * kept.len()).map(|i| f16::from_f64(noise(seed ^ 0x55, i as u64)).to_bits()).collect();
    let ranges = crate::codec::chunk_ranges(coded.clone(), chunk_tokens);
    let distinct = distinct.max(1);
    let make = |a: &Allocation, s: u64, n: usize| -> Vec<Vec<u8>> { (0..distinct).into_par_iter().map(|i| synthetic_chunk(a, n, seed.wrapping_add(s + 2 * i as u64))).collect() };
    let full = [make(ka, 0, chunk_tokens), make(va, 1, chunk_tokens)];
    let mut chunks = Vec::with_capacity(2 * ranges.len());
    for (i, r) in ranges.iter().enumerate() {
        for (side, s, a) in [(Side::Keys, 0usize, ka), (Side::Values, 1, va)] {
            let raw = if r.len() == chunk_tokens { full[s][i % distinct].clone() } else { synthetic_chunk(a, r.len(), seed.wrapping_add(999 + s as u64)) };
            chunks.push(crate::DecodedChunk { index: (2 + 2 * i + s) as u32, side, tokens: r.clone(), raw });
        }
    }
    crate::DecodedContainer { header, k_alloc: ratio_index, v_alloc: ratio_index, positions: (0..tokens as i64).collect(), kept, kept_fp16, coded, chunks, allocs: None }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::Group;
    use crate::pack;

    fn side(blocks: Vec<crate::calib::BasisBlock>) -> SideCalib {
        let comps = blocks.last().unwrap().components.end;
        SideCalib { mean: vec![], basis: vec![], variance: vec![0.0; comps], allocations: vec![], blocks, scale: vec![] }
    }

    #[test]
    fn group_table_covers_every_column_once_and_dequant_matches_decode() {
        use crate::calib::BasisBlock;
        let one = side(vec![BasisBlock { features: 0..64, components: 0..64 }]);
        let two = side(vec![BasisBlock { features: 0..64, components: 0..64 }, BasisBlock { features: 64..128, components: 64..128 }]);
        let groups = vec![Group::new(0, 1, 8), Group::new(1, 16, 3), Group::new(20, 16, 1), Group::new(36, 1, 13)];
        let mut groups2 = groups.clone();
        groups2.push(Group::new(64, 16, 2));
        groups2.push(Group::new(100, 1, 5));
        for (s, groups, want_cols) in [(&one, groups, vec![(0, 64)]), (&two, groups2, vec![(0, 64), (64, 64)])] {
            let alloc = Allocation { budget_bits: 100_000, expected_error: 0.0, groups, models: Vec::new(), step: 0.0, dead_zone: 0.0 };
            let layout = device_layout(s, &alloc);
            assert_eq!(layout.cols, want_cols);
            let ldc = layout.ldc;
            // component -> device column
            let col = |c: usize| {
                let b = s.block_of(c);
                layout.cols[b].0 + c - s.blocks[b].components.start
            };
            for n in [1usize, 5, 256] {
                let table = group_table(s, &alloc, &layout, n);
                let mut seen = vec![0; ldc];
                for g in &table {
                    (g.start..g.start + g.len).for_each(|c| seen[c as usize] += 1);
                }
                assert!(seen.iter().all(|&k| k == 1), "{seen:?}");
                let comps = alloc.used_components();
                let d: Vec<f64> = (0..n * comps).map(|k| (((k as u64 * 2654435761) % 1000) as f64 - 500.0) / 37.0).collect();
                let raw = pack::encode(&d, n, comps, &alloc);
                let want = pack::decode(&raw, n, comps, &alloc);
                let got = dequant_reference(&raw, n, &table, ldc);
                for t in 0..n {
                    let mut expect = vec![0.0; ldc];
                    for c in 0..comps {
                        if col(c) < ldc {
                            expect[col(c)] = want[t * comps + c];
                        }
                    }
                    assert_eq!(&got[t * ldc..(t + 1) * ldc], &expect[..]);
                }
            }
        }
    }
}
