//! A KV cache dump: every layer's keys and values of one sequence (or of several captured
//! windows, one after another) with the token positions, as a `.safetensors` file:
//!
//! | tensor | dtype | shape | what |
//! |---|---|---|---|
//! | `k.L00` … `k.L{L-1}` | F16, BF16 or F32 | `[kv_heads, tokens, head_dim]` | post-RoPE keys as the cache holds them |
//! | `v.L00` … | same | same | values |
//! | `positions` (optional) | I64 or I32 | `[tokens]` | RoPE position of each token; absent means `0..tokens` |
//!
//! `benches/quality/capture_keys.py` writes this layout (`kv-emma-per-layer.safetensors`);
//! `kvforge pack` reads it and `kvforge unpack` writes it back (F16).

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::error::{KvtcError, Result};

/// Keys and values of `layers × kv_heads` heads over `tokens` tokens, in f32.
#[derive(Clone, Debug, PartialEq)]
pub struct KvDump {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub tokens: usize,
    /// RoPE position of every token.
    pub positions: Vec<i64>,
    /// `[layer][head][token][channel]`.
    pub k: Vec<f32>,
    /// `[layer][head][token][channel]`.
    pub v: Vec<f32>,
}

impl KvDump {
    /// Index of `(layer, head, token, channel)` in `k` / `v`.
    pub fn at(&self, l: usize, h: usize, t: usize, c: usize) -> usize {
        ((l * self.kv_heads + h) * self.tokens + t) * self.head_dim + c
    }

    /// Features per token of one side (`layers · kv_heads · head_dim`), the PCA's dimension.
    pub fn features(&self) -> usize {
        self.layers * self.kv_heads * self.head_dim
    }

    /// Checks that the arrays match the shape.
    pub fn validate(&self) -> Result<()> {
        let n = self.features() * self.tokens;
        if self.k.len() != n || self.v.len() != n || self.positions.len() != self.tokens {
            return Err(KvtcError::BadInput(format!("dump arrays do not match {} layers × {} kv heads × {} tokens × head_dim {}", self.layers, self.kv_heads, self.tokens, self.head_dim)));
        }
        if self.head_dim == 0 || self.layers == 0 || self.kv_heads == 0 {
            return Err(KvtcError::BadInput("dump has an empty dimension".into()));
        }
        Ok(())
    }

    /// Reads a dump file (see the module doc for the layout).
    pub fn load(path: &Path) -> Result<Self> {
        Ok(Self::load_with_metadata(path)?.0)
    }

    /// Reads a dump file and its safetensors metadata (`rope_theta`, ... where the writer put them).
    pub fn load_with_metadata(path: &Path) -> Result<(Self, HashMap<String, String>)> {
        let bytes = std::fs::read(path).map_err(|source| KvtcError::Io { path: path.into(), source })?;
        let bad = |message: String| KvtcError::BadTensorFile { path: path.into(), message };
        let meta = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?.1.metadata().clone().unwrap_or_default();
        Ok((Self::from_bytes(&bytes).map_err(bad)?, meta))
    }

    fn from_bytes(bytes: &[u8]) -> std::result::Result<Self, String> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let mut layers = 0;
        while st.tensor(&format!("k.L{layers:02}")).is_ok() {
            layers += 1;
        }
        if layers == 0 {
            return Err("no tensor `k.L00` (expected k.L00.., v.L00.. of shape [kv_heads, tokens, head_dim])".into());
        }
        let shape = st.tensor("k.L00").map_err(|e| e.to_string())?.shape().to_vec();
        let [kv_heads, tokens, head_dim] = shape[..] else {
            return Err(format!("k.L00 has shape {shape:?}, expected [kv_heads, tokens, head_dim]"));
        };
        let per = kv_heads * tokens * head_dim;
        let mut k = Vec::with_capacity(per * layers);
        let mut v = Vec::with_capacity(per * layers);
        for l in 0..layers {
            for (side, out) in [("k", &mut k), ("v", &mut v)] {
                let name = format!("{side}.L{l:02}");
                let t = st.tensor(&name).map_err(|_| format!("missing tensor {name} (k.L00 exists, so every layer needs k and v)"))?;
                if t.shape() != shape {
                    return Err(format!("{name} has shape {:?}, k.L00 has {shape:?}", t.shape()));
                }
                out.extend(to_f32(t.dtype(), t.data()).ok_or_else(|| format!("{name}: dtype {:?} (expected F16, BF16 or F32)", t.dtype()))?);
            }
        }
        let positions = match st.tensor("positions") {
            Ok(t) => {
                if t.shape() != [tokens] {
                    return Err(format!("positions has shape {:?}, expected [{tokens}]", t.shape()));
                }
                match t.dtype() {
                    Dtype::I64 => t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
                    Dtype::I32 => t.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
                    d => return Err(format!("positions: dtype {d:?} (expected I64 or I32)")),
                }
            }
            Err(_) => (0..tokens as i64).collect(),
        };
        Ok(Self { layers, kv_heads, head_dim, tokens, positions, k, v })
    }

    /// Writes the dump (keys and values as F16, positions as I64) with `metadata`.
    pub fn save(&self, path: &Path, metadata: HashMap<String, String>) -> Result<()> {
        self.validate()?;
        let per = self.kv_heads * self.tokens * self.head_dim;
        let shape = vec![self.kv_heads, self.tokens, self.head_dim];
        let f16_bytes = |x: &[f32]| x.iter().flat_map(|&a| f16::from_f32(a).to_le_bytes()).collect::<Vec<u8>>();
        let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for l in 0..self.layers {
            bufs.push((format!("k.L{l:02}"), Dtype::F16, shape.clone(), f16_bytes(&self.k[l * per..(l + 1) * per])));
            bufs.push((format!("v.L{l:02}"), Dtype::F16, shape.clone(), f16_bytes(&self.v[l * per..(l + 1) * per])));
        }
        bufs.push(("positions".into(), Dtype::I64, vec![self.tokens], self.positions.iter().flat_map(|p| p.to_le_bytes()).collect()));
        let views: Vec<(String, safetensors::tensor::TensorView)> =
            bufs.iter().map(|(n, d, s, b)| Ok((n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).map_err(|e| KvtcError::BadInput(e.to_string()))?))).collect::<Result<_>>()?;
        let out = safetensors::serialize(views, &Some(metadata)).map_err(|e| KvtcError::BadInput(e.to_string()))?;
        std::fs::write(path, out).map_err(|source| KvtcError::Io { path: path.into(), source })
    }
}

/// Little-endian F16 / BF16 / F32 bytes to f32 (None for other dtypes).
pub(crate) fn to_f32(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F16 => data.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        _ => return None,
    })
}
