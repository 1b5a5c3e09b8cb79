//! Identity coding in fp16 or bf16: row-major `[tokens][d]` elements, little endian. Rounding
//! is round-to-nearest-even, as CUDA's `__float2half` / `__float2bfloat16` do.

use crate::DType;
use half::{bf16, f16};

/// Bytes of one element of `dtype`.
pub const ELEMENT_BYTES: usize = 2;

/// `x` rounded to `dtype` and widened to f64: the value a dense page holds for `x`.
pub fn round(dtype: DType, x: f32) -> f64 {
    match dtype {
        DType::Fp16 => f16::from_f32(x).to_f64(),
        DType::Bf16 => bf16::from_f32(x).to_f64(),
    }
}

/// Writes `x` as `dtype` elements into `out` (`2 * x.len()` bytes).
pub fn encode(dtype: DType, x: &[f32], out: &mut [u8]) {
    for (o, &v) in out.chunks_exact_mut(ELEMENT_BYTES).zip(x) {
        let b = match dtype {
            DType::Fp16 => f16::from_f32(v).to_le_bytes(),
            DType::Bf16 => bf16::from_f32(v).to_le_bytes(),
        };
        o.copy_from_slice(&b);
    }
}

/// Reads `dtype` elements from `bytes`.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(ELEMENT_BYTES)
        .map(|b| match dtype {
            DType::Fp16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
            DType::Bf16 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_is_the_rounded_value() {
        let x = [0.0f32, 1.0, -2.5, 1e-3, 65504.0, 1.234567, -1e-7];
        for dt in [DType::Fp16, DType::Bf16] {
            let mut b = vec![0u8; 2 * x.len()];
            encode(dt, &x, &mut b);
            let y = decode(dt, &b);
            for (a, b) in x.iter().zip(&y) {
                assert_eq!(round(dt, *a), *b);
            }
        }
    }

    #[test]
    fn fp16_is_little_endian() {
        let mut b = [0u8; 2];
        encode(DType::Fp16, &[1.0], &mut b);
        assert_eq!(b, [0x00, 0x3c]);
        encode(DType::Bf16, &[1.0], &mut b);
        assert_eq!(b, [0x80, 0x3f]);
    }
}
