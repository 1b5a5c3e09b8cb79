//! Group quantisation in the decorrelated domain: a group of consecutive PCA coordinates of
//! one token shares a 16-bit shift (`lo`, fp16) and a 16-bit scale (fp16), and every
//! coordinate is a `bits`-bit code `round((x - lo) / scale)` (asymmetric min/max, the
//! microscaling-style grouping of kvtc §3.2). Zero bits means the coordinates are dropped
//! (restored as 0, i.e. the calibration mean after the inverse projection) and cost nothing.

use half::f16;

/// Bits of side information per group: fp16 shift + fp16 scale.
pub const GROUP_OVERHEAD_BITS: u32 = 32;

/// Widest code a group may use.
pub const MAX_BITS: u8 = 16;

/// One group's fp16 shift and scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupScale {
    pub lo: f16,
    pub scale: f16,
}

fn step_down(x: f16) -> f16 {
    let b = x.to_bits();
    if x.is_nan() || x == f16::NEG_INFINITY {
        x
    } else if b == 0 || b == 0x8000 {
        f16::from_bits(0x8001)
    } else if b & 0x8000 == 0 {
        f16::from_bits(b - 1)
    } else {
        f16::from_bits(b + 1)
    }
}

fn step_up(x: f16) -> f16 {
    let b = x.to_bits();
    if x.is_nan() || x == f16::INFINITY {
        x
    } else if b == 0 || b == 0x8000 {
        f16::from_bits(0x0001)
    } else if b & 0x8000 == 0 {
        f16::from_bits(b + 1)
    } else {
        f16::from_bits(b - 1)
    }
}

const F16_MAX: f64 = 65504.0;

impl GroupScale {
    /// Shift and scale covering `xs` with `bits`-bit codes: `lo ≤ min`, `lo + scale·(2^bits-1) ≥ max`
    /// wherever fp16 can represent it (values are clamped to ±65504 first).
    pub fn fit(xs: impl Iterator<Item = f64>, bits: u8) -> Self {
        let (mut mn, mut mx) = (f64::INFINITY, f64::NEG_INFINITY);
        for x in xs {
            mn = mn.min(x);
            mx = mx.max(x);
        }
        Self::fit_range(mn, mx, bits)
    }

    /// [`GroupScale::fit`] from the group's minimum and maximum.
    pub fn fit_range(mn: f64, mx: f64, bits: u8) -> Self {
        let (mn, mx) = (if mn.is_nan() { 0.0 } else { mn.clamp(-F16_MAX, F16_MAX) }, if mx.is_nan() { 0.0 } else { mx.clamp(-F16_MAX, F16_MAX) });
        if !mn.is_finite() || mn > mx {
            return Self { lo: f16::ZERO, scale: f16::ZERO };
        }
        let mut lo = f16::from_f64(mn);
        if lo.to_f64() > mn {
            lo = step_down(lo);
        }
        let levels = ((1u32 << bits) - 1) as f64;
        let span = mx - lo.to_f64();
        if span <= 0.0 {
            return Self { lo, scale: f16::ZERO };
        }
        let mut scale = f16::from_f64((span / levels).min(F16_MAX));
        if scale.to_f64() * levels + lo.to_f64() < mx && scale.to_f64() < F16_MAX {
            scale = step_up(scale);
        }
        Self { lo, scale }
    }

    /// The code of `x`: `(x − lo) / scale` rounded half up, clamped to `0 ..= 2^bits − 1`.
    #[inline]
    pub fn code(&self, x: f64, bits: u8) -> u32 {
        let s = self.scale.to_f64();
        if s <= 0.0 || x.is_nan() {
            return 0;
        }
        code_of(x, self.lo.to_f64(), 1.0 / s, ((1u32 << bits) - 1) as f64) as u32
    }

    /// The value a code stands for.
    #[inline]
    pub fn value(&self, code: u32) -> f64 {
        self.lo.to_f64() + code as f64 * self.scale.to_f64()
    }
}

/// Fractions of a group's min/max range (about its midpoint) the fit tries for `bits`-bit
/// codes, the full range first: the fewer the levels, the more it pays to clip the extremes.
pub fn clip_fractions(bits: u8) -> &'static [f64] {
    match bits {
        0 | 1 => &[1.0, 0.7, 0.5, 0.38, 0.3, 0.23, 0.17],
        2 => &[1.0, 0.8, 0.65, 0.53, 0.44, 0.36, 0.29],
        3 => &[1.0, 0.85, 0.73, 0.63, 0.54, 0.46],
        4 => &[1.0, 0.88, 0.78, 0.69, 0.6],
        5 => &[1.0, 0.9, 0.81, 0.73],
        _ => &[1.0, 0.92, 0.85],
    }
}

/// The code of `x` as a float: `(x − lo) · inv + ½` truncated after clamping to `[0, levels + ½]`
/// (round half up, then clamp). Truncation instead of `round` keeps the DP's inner loop free of
/// library calls; [`GroupScale::code`] and [`sq_error_with`] share it, so the DP's errors are
/// the encoder's exactly.
#[inline(always)]
fn code_of(x: f64, lo: f64, inv: f64, levels: f64) -> f64 {
    ((x - lo) * inv + 0.5).max(0.0).min(levels + 0.5) as u32 as f64
}

/// Squared error of `xs` quantised with `g` (the same arithmetic as `code` then `value`).
#[inline]
fn sq_error_with(xs: &[f64], g: GroupScale, bits: u8) -> f64 {
    let (lo, s) = (g.lo.to_f64(), g.scale.to_f64());
    if s <= 0.0 {
        return xs.iter().map(|&x| (lo - x) * (lo - x)).sum::<f64>();
    }
    let (inv, levels) = (1.0 / s, ((1u32 << bits) - 1) as f64);
    xs.iter()
        .map(|&x| {
            let d = lo + code_of(x, lo, inv, levels) * s - x;
            d * d
        })
        .sum::<f64>()
}

/// The shift and scale the encoder uses for `xs` (minimum `mn`, maximum `mx`) with `bits`-bit
/// codes, and their squared error: of the min/max range shrunk by each of [`clip_fractions`],
/// the one of least error (the first on ties, so min/max when clipping does not help).
pub fn best_fit(xs: &[f64], mn: f64, mx: f64, bits: u8) -> (GroupScale, f64) {
    let full = GroupScale::fit_range(mn, mx, bits);
    let mut best = (full, sq_error_with(xs, full, bits));
    if !(mn < mx) || best.1 == 0.0 {
        return best;
    }
    let (mid, half) = (0.5 * (mn + mx), 0.5 * (mx - mn));
    for &f in &clip_fractions(bits)[1..] {
        let g = GroupScale::fit_range(mid - f * half, mid + f * half, bits);
        let e = sq_error_with(xs, g, bits);
        if e < best.1 {
            best = (g, e);
        }
    }
    best
}

/// The shift and scale the encoder uses for `xs` with `bits`-bit codes ([`best_fit`]).
pub fn fit_group(xs: &[f64], bits: u8) -> GroupScale {
    let (mn, mx) = min_max(xs);
    best_fit(xs, mn, mx, bits).0
}

/// How a group's per-token range is chosen.
///
/// With fixed-width codes the least-error range ([`Fit::Clip`]) is best: it spreads the codes
/// over all levels, so their histogram is nearly flat and an entropy coder gains little. With
/// model-coded groups (an allocation solved with [`crate::alloc::DpConfig::coded`]) a wider
/// range at more levels can cost fewer coded bits for the same error (entropy-constrained
/// scalar quantisation): [`Fit::MinMax`] keeps every value inside the range, the codes
/// concentrate about the middle and their entropy falls well below the width. The DP chooses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fit {
    /// Per token, the range of least squared error among [`clip_fractions`] ([`best_fit`]).
    #[default]
    Clip,
    /// Per token, the group's minimum and maximum.
    MinMax,
    /// The allocation's one step `Δ` for every token, centred on zero: `lo = −2^(bits−1)·Δ`,
    /// `scale = Δ` ([`step_scale`]; [`crate::step`]: entropy-constrained quantisation, the
    /// scales are constants and cost nothing).
    Step,
}

impl Fit {
    pub fn id(self) -> u8 {
        match self {
            Fit::Clip => 0,
            Fit::MinMax => 1,
            Fit::Step => 2,
        }
    }

    pub fn from_id(id: u8) -> Option<Self> {
        match id {
            0 => Some(Fit::Clip),
            1 => Some(Fit::MinMax),
            2 => Some(Fit::Step),
            _ => None,
        }
    }
}

/// The shift and scale of a [`Fit::Step`] group of `bits`-bit codes with step `step`.
pub fn step_scale(step: f32, bits: u8) -> GroupScale {
    let d = f16::from_f32(step);
    GroupScale { lo: f16::from_f64(-(2f64.powi(bits as i32 - 1)) * d.to_f64()), scale: d }
}

/// The code of `x` in a [`Fit::Step`] group (`g` from [`step_scale`]) with a dead zone: the
/// magnitude `|x| / Δ` is rounded with its thresholds `dead_zone` steps further from zero than
/// the midpoints (`m = ⌊|x|/Δ + ½ − dead_zone⌋`, the sign kept), so values near a threshold fall
/// to the code nearer zero. Near zero the codes are the likeliest, so that trades a little
/// error for fewer coded bits (entropy-constrained scalar quantisation with a dead zone, as
/// video coders round their transform coefficients). The decoder is unchanged: code `c` still
/// stands for `lo + c·Δ`. A dead zone of 0 is [`GroupScale::code`] exactly.
#[inline]
pub fn step_code(g: GroupScale, x: f64, bits: u8, dead_zone: f32) -> u32 {
    if dead_zone == 0.0 {
        return g.code(x, bits);
    }
    let s = g.scale.to_f64();
    if s <= 0.0 || x.is_nan() {
        return 0;
    }
    let h = (1u32 << (bits - 1)) as f64;
    let m = (x.abs() / s + 0.5 - dead_zone as f64).max(0.0).floor();
    let c = if x < 0.0 { h - m } else { h + m };
    c.clamp(0.0, ((1u32 << bits) - 1) as f64) as u32
}

/// The code of `x` in a group of range choice `fit` with shift and scale `g`: [`step_code`]
/// for [`Fit::Step`], [`GroupScale::code`] otherwise.
#[inline]
pub fn code_with(g: GroupScale, x: f64, bits: u8, fit: Fit, dead_zone: f32) -> u32 {
    if fit == Fit::Step {
        step_code(g, x, bits, dead_zone)
    } else {
        g.code(x, bits)
    }
}

/// The shift and scale the encoder uses for `xs` with `bits`-bit codes, range choice `fit` and
/// (for [`Fit::Step`]) the allocation's step.
pub fn fit_group_with(xs: &[f64], bits: u8, fit: Fit, step: f32) -> GroupScale {
    match fit {
        Fit::Clip => fit_group(xs, bits),
        Fit::MinMax => GroupScale::fit(xs.iter().copied(), bits),
        Fit::Step => step_scale(step, bits),
    }
}

/// Squared error of quantising `xs` with `bits` bits and range choice `fit` (a [`Fit::Step`]
/// group with the allocation's step and dead zone, [`step_code`]).
pub fn group_sq_error_with(xs: &[f64], bits: u8, fit: Fit, step: f32, dead_zone: f32) -> f64 {
    let g = fit_group_with(xs, bits, fit, step);
    if fit == Fit::Step && dead_zone != 0.0 {
        return xs.iter().map(|&x| (g.value(step_code(g, x, bits, dead_zone)) - x).powi(2)).sum();
    }
    sq_error_with(xs, g, bits)
}

/// `errs[q] += ` the squared error and `hists[q][code] += 1` for every code of quantising `xs`
/// with candidate `q` of `cands` (`(bits, fit)`; `hists[q]` holds `2^bits` counts; `step` and
/// `dead_zone` for [`Fit::Step`]): the coded DP's inner loop. The errors equal
/// [`group_sq_error_with`] term by term.
pub fn add_group_stats(xs: &[f64], cands: &[(u8, Fit)], step: f32, dead_zone: f32, errs: &mut [f64], hists: &mut [Vec<u32>]) {
    let (mn, mx) = min_max(xs);
    for ((&(bits, fit), e), h) in cands.iter().zip(errs.iter_mut()).zip(hists.iter_mut()) {
        let g = match fit {
            Fit::Clip => best_fit(xs, mn, mx, bits).0,
            Fit::MinMax => GroupScale::fit_range(mn, mx, bits),
            Fit::Step => step_scale(step, bits),
        };
        let (lo, s) = (g.lo.to_f64(), g.scale.to_f64());
        if s <= 0.0 {
            *e += xs.iter().map(|&x| (lo - x) * (lo - x)).sum::<f64>();
            h[0] += xs.len() as u32;
            continue;
        }
        if fit == Fit::Step && dead_zone != 0.0 {
            for &x in xs {
                let c = step_code(g, x, bits, dead_zone);
                *e += (g.value(c) - x).powi(2);
                h[c as usize] += 1;
            }
            continue;
        }
        let (inv, levels) = (1.0 / s, ((1u32 << bits) - 1) as f64);
        for &x in xs {
            let c = code_of(x, lo, inv, levels);
            let d = lo + c * s - x;
            *e += d * d;
            h[c as usize] += 1;
        }
    }
}

fn min_max(xs: &[f64]) -> (f64, f64) {
    xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)))
}

/// Squared error of quantising `xs` (one group of one token) with `bits` bits, as the encoder
/// does ([`fit_group`]).
pub fn group_sq_error(xs: &[f64], bits: u8) -> f64 {
    let (mn, mx) = min_max(xs);
    best_fit(xs, mn, mx, bits).1
}

/// `out[q] += ` squared error of quantising `xs` with `bit_widths[q]` bits: the DP's inner
/// loop, with the min/max found once for every width. Equal to [`group_sq_error`] term by term.
pub fn add_group_errors(xs: &[f64], bit_widths: &[u8], out: &mut [f64]) {
    let (mn, mx) = min_max(xs);
    for (o, &bits) in out.iter_mut().zip(bit_widths) {
        *o += best_fit(xs, mn, mx, bits).1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn codes_cover_the_range(xs in proptest::collection::vec(-1000.0f64..1000.0, 1..40), bits in 1u8..=8) {
            let g = GroupScale::fit(xs.iter().copied(), bits);
            let mn = xs.iter().cloned().fold(f64::INFINITY, f64::min);
            let mx = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            prop_assert!(g.lo.to_f64() <= mn);
            let top = g.value((1 << bits) - 1);
            prop_assert!(top >= mx || g.scale == f16::ZERO);
            // every value lands within one step of its code (rounding), plus fp16 slack
            let s = g.scale.to_f64();
            for &x in &xs {
                let e = (g.value(g.code(x, bits)) - x).abs();
                prop_assert!(e <= 0.5 * s + 1e-9, "x {} err {} step {}", x, e, s);
            }
        }
    }

    #[test]
    fn dp_errors_match_group_errors() {
        let xs: Vec<f64> = (0..37).map(|i| ((i * 7919) % 101) as f64 * 0.31 - 9.0).collect();
        let widths = [1u8, 2, 3, 5, 8];
        let mut out = [0.0; 5];
        add_group_errors(&xs, &widths, &mut out);
        for (o, &b) in out.iter().zip(&widths) {
            assert_eq!(*o, group_sq_error(&xs, b));
        }
    }

    /// The clipped fit is never worse than min/max, keeps every code in range, and on a
    /// bell-shaped group of 256 at 2 bits cuts the error well below min/max's.
    #[test]
    fn clipping_never_hurts_and_helps_at_few_bits() {
        // a deterministic bell shape: the sum of four uniform(-1, 1) hashes
        let bell = |i: usize| (0..4).map(|k| (((i * 4 + k) as u64 * 2654435761 % 10007) as f64 / 10007.0) * 2.0 - 1.0).sum::<f64>();
        let xs: Vec<f64> = (0..256).map(bell).collect();
        for bits in 1..=8u8 {
            let g = GroupScale::fit(xs.iter().copied(), bits);
            let minmax: f64 = xs.iter().map(|&x| (g.value(g.code(x, bits)) - x).powi(2)).sum();
            let clipped = group_sq_error(&xs, bits);
            assert!(clipped <= minmax, "bits {bits}: {clipped} > {minmax}");
            let f = fit_group(&xs, bits);
            assert_eq!(xs.iter().map(|&x| (f.value(f.code(x, bits)) - x).powi(2)).sum::<f64>(), clipped);
            if bits <= 2 {
                assert!(clipped < 0.7 * minmax, "bits {bits}: clipped {clipped} vs min/max {minmax}");
            }
        }
        // one value, or all equal: exact up to fp16, as before
        assert_eq!(fit_group(&[3.0], 2), GroupScale::fit([3.0].into_iter(), 2));
        assert_eq!(fit_group(&[-1.5, -1.5], 1), GroupScale::fit([-1.5, -1.5].into_iter(), 1));
    }

    /// The dead zone moves codes only toward zero, by at most one, keeps every value within
    /// `(½ + dead_zone)·Δ` of its code inside the range, and is the plain code at 0.
    #[test]
    fn step_codes_with_a_dead_zone() {
        let step = 0.37f32;
        for bits in [2u8, 3, 6] {
            let g = step_scale(step, bits);
            let h = 1i64 << (bits - 1);
            for i in -4000..4000 {
                let x = i as f64 * 0.0013 * (1 << bits) as f64;
                let near = g.code(x, bits) as i64;
                assert_eq!(step_code(g, x, bits, 0.0) as i64, near);
                let c = step_code(g, x, bits, 0.25) as i64;
                assert!((c - h).abs() <= (near - h).abs() && (near - c).abs() <= 1, "x {x}: {c} vs {near}");
                if (x / step as f64).abs() < (h - 1) as f64 {
                    assert!((g.value(c as u32) - x).abs() <= 0.75 * g.scale.to_f64() + 1e-9, "x {x}");
                }
                let mut e = [0.0];
                let mut hist = vec![vec![0u32; 1 << bits]];
                add_group_stats(&[x], &[(bits, Fit::Step)], step, 0.25, &mut e, &mut hist);
                assert_eq!(hist[0][c as usize], 1);
                assert_eq!(e[0], group_sq_error_with(&[x], bits, Fit::Step, step, 0.25));
            }
        }
    }

    #[test]
    fn more_bits_less_error() {
        let xs: Vec<f64> = (0..64).map(|i| ((i * 7919) % 101) as f64 * 0.13 - 5.0).collect();
        let errs: Vec<f64> = (1..=8).map(|b| group_sq_error(&xs, b)).collect();
        for w in errs.windows(2) {
            assert!(w[1] <= w[0]);
        }
        assert!(errs[7] < 1e-2 * errs[0]);
    }
}
