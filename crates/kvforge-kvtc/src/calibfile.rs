//! The calibration file: safetensors, so that a spec can point at it by path and any tool can
//! open it. Version 1:
//!
//! | tensor | dtype | shape | what |
//! |---|---|---|---|
//! | `k.mean`, `v.mean` | F32 | `[p]` | per-feature mean, `p = layers · kv_heads · head_dim`, feature `(layer · kv_heads + head) · head_dim + channel` |
//! | `k.basis`, `v.basis` | F32 | `[components, p]` | principal directions (rows, orthonormal), by decreasing variance |
//! | `k.variance`, `v.variance` | F32 | `[components]` | variance along each direction |
//! | `k.alloc`, `v.alloc` | I32 | `[groups, 4]` | rows `(ratio index, start, len, bits)` of every allocation, in order |
//! | `k.blocks`, `v.blocks` | I32 | `[blocks, 4]` | version ≥ 2 only: rows `(first feature, features, first component, components)` of a block-diagonal basis ([`crate::calib::BasisBlock`]); `k.basis` is then flat, `[Σ components · features]`, block after block |
//! | `k.scale`, `v.scale` | F32 | `[p]` | version 3 only, optional per side: per-feature scale `s` of a weighted calibration ([`SideCalib::scale`]); `k.basis` then holds `u ⊘ s` (restore unchanged), projecting multiplies the centred features by `s²` |
//!
//! | `k.models`, `v.models` | U32 | `[entries]` | version 4 only: the code models of a coded calibration ([`crate::model`]), every group of every allocation in order, `2^bits` probabilities per model; `k.alloc` then has six columns: `(ratio index, start, len, bits, fit, models)`, the group's range choice ([`crate::quant::Fit`] id) and its number of models (1 pooled, or `len`), and the metadata `k.steps` / `v.steps` the step of each allocation ([`crate::step`]; 0 when unused), and optionally `k.dead_zones` / `v.dead_zones` the encoder's dead zone of each ([`crate::quant::step_code`]; absent: 0) |
//!
//! Version 1 is a basis over all features (one block); a multi-block basis
//! (`layers_per_basis`) is written as version 2, a weighted one (either side has a scale) as
//! version 3 and a coded one (`--coded`: allocations with code models) as version 4; this build
//! reads all four.
//!
//! Metadata (strings): `format` = `kvforge-kvtc-calibration`, `version` = `1`, `layers`,
//! `kv_heads`, `head_dim`, `rope_theta` and `rope_dim` (absent: keys not de-rotated), `sinks`,
//! `window`, `samples`, `ratios` (comma-separated), `k.budgets` / `v.budgets` (bits per token
//! of each ratio, comma-separated), `id` (hex of [`Calibration::id`], checked on load), and any
//! free-form fields the writer adds (`source`, ...).

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::alloc::{Allocation, Group};
use crate::calib::{BasisBlock, Calibration, SideCalib, BLOCK_ALIGN};
use crate::error::{KvtcError, Result};
use crate::quant::Fit;
use crate::rope::Rope;

pub const FORMAT: &str = "kvforge-kvtc-calibration";
pub const VERSION: u32 = 4;

impl Calibration {
    /// Writes the calibration with `extra` metadata.
    pub fn save(&self, path: &Path, extra: &HashMap<String, String>) -> Result<()> {
        let mut meta = extra.clone();
        let mut put = |k: &str, v: String| meta.insert(k.to_string(), v);
        put("format", FORMAT.into());
        let multi = self.k.blocks.len() > 1 || self.v.blocks.len() > 1;
        let weighted = !self.k.scale.is_empty() || !self.v.scale.is_empty();
        let coded = [&self.k, &self.v].iter().any(|s| s.allocations.iter().any(Allocation::coded));
        put(
            "version",
            if coded {
                4
            } else if weighted {
                3
            } else if multi {
                2
            } else {
                1
            }
            .to_string(),
        );
        put("layers", self.layers.to_string());
        put("kv_heads", self.kv_heads.to_string());
        put("head_dim", self.head_dim.to_string());
        if let Some(r) = self.rope {
            put("rope_theta", format!("{:?}", r.theta));
            put("rope_dim", r.dim.to_string());
        }
        put("sinks", self.sinks.to_string());
        put("window", self.window.to_string());
        put("samples", self.samples.to_string());
        put("ratios", self.ratios.iter().map(|r| format!("{r:?}")).collect::<Vec<_>>().join(","));
        let coded_file = [&self.k, &self.v].iter().any(|s| s.allocations.iter().any(Allocation::coded));
        for (n, s) in [("k", &self.k), ("v", &self.v)] {
            put(&format!("{n}.budgets"), s.allocations.iter().map(|a| a.budget_bits.to_string()).collect::<Vec<_>>().join(","));
            if coded_file {
                put(&format!("{n}.steps"), s.allocations.iter().map(|a| format!("{:?}", a.step)).collect::<Vec<_>>().join(","));
                if s.allocations.iter().any(|a| a.dead_zone != 0.0) {
                    put(&format!("{n}.dead_zones"), s.allocations.iter().map(|a| format!("{:?}", a.dead_zone)).collect::<Vec<_>>().join(","));
                }
            }
        }
        put("id", self.id_hex());
        let p = self.features();
        let f32b = |x: &[f32]| x.iter().flat_map(|a| a.to_le_bytes()).collect::<Vec<u8>>();
        let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (n, s) in [("k", &self.k), ("v", &self.v)] {
            let c = s.components();
            bufs.push((format!("{n}.mean"), Dtype::F32, vec![p], f32b(&s.mean)));
            if multi {
                bufs.push((format!("{n}.basis"), Dtype::F32, vec![s.basis.len()], f32b(&s.basis)));
                let rows: Vec<i32> = s.blocks.iter().flat_map(|b| [b.features.start as i32, b.features.len() as i32, b.components.start as i32, b.components.len() as i32]).collect();
                bufs.push((format!("{n}.blocks"), Dtype::I32, vec![s.blocks.len(), 4], rows.iter().flat_map(|a| a.to_le_bytes()).collect()));
            } else {
                bufs.push((format!("{n}.basis"), Dtype::F32, vec![c, p], f32b(&s.basis)));
            }
            bufs.push((format!("{n}.variance"), Dtype::F32, vec![c], f32b(&s.variance)));
            if !s.scale.is_empty() {
                bufs.push((format!("{n}.scale"), Dtype::F32, vec![p], f32b(&s.scale)));
            }
            let cols = if coded { 6 } else { 4 };
            let rows: Vec<i32> = s
                .allocations
                .iter()
                .enumerate()
                .flat_map(|(i, a)| {
                    a.groups.iter().enumerate().flat_map(move |(gi, g)| {
                        let models = a.models.get(gi).map_or(0, |m| crate::model::models_in(g, m.len()));
                        [i as i32, g.start as i32, g.len as i32, g.bits as i32, g.fit.id() as i32, models as i32].into_iter().take(cols)
                    })
                })
                .collect();
            bufs.push((format!("{n}.alloc"), Dtype::I32, vec![rows.len() / cols, cols], rows.iter().flat_map(|a| a.to_le_bytes()).collect()));
            if coded {
                let m: Vec<u8> = s.allocations.iter().flat_map(|a| a.models.iter().flatten()).flat_map(|p| p.to_le_bytes()).collect();
                bufs.push((format!("{n}.models"), Dtype::U32, vec![m.len() / 4], m));
            }
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> =
            bufs.iter().map(|(n, d, s, b)| Ok((n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).map_err(|e| KvtcError::BadInput(e.to_string()))?))).collect::<Result<_>>()?;
        let out = safetensors::serialize(views, &Some(meta)).map_err(|e| KvtcError::BadInput(e.to_string()))?;
        std::fs::write(path, out).map_err(|source| KvtcError::Io { path: path.into(), source })
    }

    /// Reads and checks a calibration file (shapes, allocations within the basis, the id).
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| KvtcError::Io { path: path.into(), source })?;
        Self::from_bytes(&bytes).map_err(|message| KvtcError::BadCalibration { path: path.into(), message })
    }

    fn from_bytes(bytes: &[u8]) -> std::result::Result<Self, String> {
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |k: &str| meta.get(k).cloned().ok_or_else(|| format!("metadata has no `{k}`"));
        let num = |k: &str| get(k)?.parse::<usize>().map_err(|e| format!("metadata `{k}`: {e}"));
        if get("format")? != FORMAT {
            return Err(format!("metadata `format` is not `{FORMAT}`"));
        }
        let version = num("version")?;
        if !(1..=VERSION as usize).contains(&version) {
            return Err(format!("version {version}; this build reads versions 1 to {VERSION}"));
        }
        let (layers, kv_heads, head_dim) = (num("layers")?, num("kv_heads")?, num("head_dim")?);
        let rope = match (meta.get("rope_theta"), meta.get("rope_dim")) {
            (Some(t), Some(d)) => Some(Rope { theta: t.parse().map_err(|e| format!("rope_theta: {e}"))?, dim: d.parse().map_err(|e| format!("rope_dim: {e}"))? }),
            (None, None) => None,
            _ => return Err("rope_theta and rope_dim come together".into()),
        };
        if let Some(r) = rope {
            if r.dim % 2 != 0 || r.dim > head_dim || !(r.theta > 1.0) {
                return Err(format!("rope_dim {} / rope_theta {} invalid for head_dim {head_dim}", r.dim, r.theta));
            }
        }
        let ratios: Vec<f64> = get("ratios")?.split(',').map(|s| s.parse::<f64>().map_err(|e| format!("ratios: {e}"))).collect::<std::result::Result<_, _>>()?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let p = layers * kv_heads * head_dim;
        let side = |n: &str| -> std::result::Result<SideCalib, String> {
            let f32s = |name: &str, shape: Option<&[usize]>| -> std::result::Result<(Vec<f32>, Vec<usize>), String> {
                let t = st.tensor(name).map_err(|_| format!("missing tensor `{name}`"))?;
                if t.dtype() != Dtype::F32 {
                    return Err(format!("`{name}` is {:?}, expected F32", t.dtype()));
                }
                if let Some(s) = shape {
                    if t.shape() != s {
                        return Err(format!("`{name}` has shape {:?}, expected {s:?}", t.shape()));
                    }
                }
                Ok((t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(), t.shape().to_vec()))
            };
            let (mean, _) = f32s(&format!("{n}.mean"), Some(&[p]))?;
            let (basis, bs) = f32s(&format!("{n}.basis"), None)?;
            let blocks: Vec<BasisBlock> = match st.tensor(&format!("{n}.blocks")) {
                Err(_) => {
                    if bs.len() != 2 || bs[1] != p {
                        return Err(format!("`{n}.basis` has shape {bs:?}, expected [components, {p}]"));
                    }
                    vec![BasisBlock { features: 0..p, components: 0..bs[0] }]
                }
                Ok(t) => {
                    if version < 2 || t.dtype() != Dtype::I32 || t.shape().len() != 2 || t.shape()[1] != 4 || t.shape()[0] == 0 {
                        return Err(format!("`{n}.blocks` must be I32 [blocks, 4] in a version ≥ 2 file"));
                    }
                    let rows: Vec<i64> = t.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect();
                    let (mut f, mut c, mut total) = (0i64, 0i64, 0i64);
                    let mut out = Vec::new();
                    for r in rows.chunks_exact(4) {
                        if r[0] != f || r[1] <= 0 || r[2] != c || r[3] < 0 || r[3] > (r[1] + BLOCK_ALIGN as i64 - 1) / BLOCK_ALIGN as i64 * BLOCK_ALIGN as i64 {
                            return Err(format!("`{n}.blocks` row {r:?}: blocks must tile the features and components in order"));
                        }
                        out.push(BasisBlock { features: r[0] as usize..(r[0] + r[1]) as usize, components: r[2] as usize..(r[2] + r[3]) as usize });
                        total += r[1] * r[3];
                        (f, c) = (r[0] + r[1], r[2] + r[3]);
                    }
                    if f as usize != p || bs.len() != 1 || bs[0] as i64 != total {
                        return Err(format!("`{n}.blocks` cover {f} of {p} features, `{n}.basis` has shape {bs:?} for {total} values"));
                    }
                    out
                }
            };
            let comps = blocks.last().map_or(0, |b| b.components.end);
            let (variance, _) = f32s(&format!("{n}.variance"), Some(&[comps]))?;
            let at = st.tensor(&format!("{n}.alloc")).map_err(|_| format!("missing tensor `{n}.alloc`"))?;
            let cols = if version >= 4 { 6 } else { 4 };
            if at.dtype() != Dtype::I32 || at.shape().len() != 2 || at.shape()[1] != cols {
                return Err(format!("`{n}.alloc` must be I32 [groups, {cols}] in a version {version} file"));
            }
            let rows: Vec<i32> = at.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
            let budgets: Vec<u32> =
                get(&format!("{n}.budgets"))?.split(',').filter(|s| !s.is_empty()).map(|s| s.parse::<u32>().map_err(|e| format!("{n}.budgets: {e}"))).collect::<std::result::Result<_, _>>()?;
            if budgets.len() != ratios.len() {
                return Err(format!("{n}.budgets has {} entries for {} ratios", budgets.len(), ratios.len()));
            }
            let mut allocations: Vec<Allocation> = budgets.iter().map(|&b| Allocation { budget_bits: b, groups: Vec::new(), expected_error: f64::NAN, models: Vec::new(), step: 0.0, dead_zone: 0.0 }).collect();
            let mut counts: Vec<Vec<usize>> = vec![Vec::new(); allocations.len()];
            for r in rows.chunks_exact(cols) {
                let (i, start, len, bits) = (r[0], r[1], r[2], r[3]);
                let fit = if cols == 6 { u8::try_from(r[4]).ok().and_then(Fit::from_id) } else { Some(Fit::Clip) };
                let models = if cols == 6 { r[5] } else { 0 };
                let Some(fit) = fit.filter(|_| !(i < 0 || i as usize >= allocations.len() || start < 0 || len <= 0 || !(1..=16).contains(&bits) || !(models == 0 || models == 1 || models == len))) else {
                    return Err(format!("`{n}.alloc` row {r:?} is invalid"));
                };
                allocations[i as usize].groups.push(Group { start: start as u32, len: len as u32, bits: bits as u8, fit });
                counts[i as usize].push(models as usize);
            }
            if version >= 4 {
                let steps: Vec<f32> = get(&format!("{n}.steps"))?.split(',').filter(|s| !s.is_empty()).map(|s| s.parse::<f32>().map_err(|e| format!("{n}.steps: {e}"))).collect::<std::result::Result<_, _>>()?;
                if steps.len() != allocations.len() {
                    return Err(format!("{n}.steps has {} entries for {} ratios", steps.len(), allocations.len()));
                }
                allocations.iter_mut().zip(steps).for_each(|(a, s)| a.step = s);
                if let Ok(dz) = get(&format!("{n}.dead_zones")) {
                    let dz: Vec<f32> = dz.split(',').filter(|s| !s.is_empty()).map(|s| s.parse::<f32>().map_err(|e| format!("{n}.dead_zones: {e}"))).collect::<std::result::Result<_, _>>()?;
                    if dz.len() != allocations.len() || dz.iter().any(|d| !(0.0..0.5).contains(d)) {
                        return Err(format!("{n}.dead_zones: {} entries in [0, 0.5) needed for {} ratios, got {dz:?}", allocations.len(), allocations.len()));
                    }
                    allocations.iter_mut().zip(dz).for_each(|(a, d)| a.dead_zone = d);
                }
            }
            if let Ok(t) = st.tensor(&format!("{n}.models")) {
                if version < 4 || t.dtype() != Dtype::U32 || t.shape().len() != 1 {
                    return Err(format!("`{n}.models` must be U32 [entries] in a version 4 file"));
                }
                let probs: Vec<u32> = t.data().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                let need: usize = allocations.iter().zip(&counts).flat_map(|(a, c)| a.groups.iter().zip(c)).map(|(g, &m)| m << g.bits.min(16)).sum();
                if probs.len() != need {
                    return Err(format!("`{n}.models` holds {} probabilities, the groups need {need}", probs.len()));
                }
                let mut at = 0;
                for (a, c) in allocations.iter_mut().zip(&counts) {
                    if c.iter().all(|&m| m == 0) {
                        continue;
                    }
                    let mut models = Vec::with_capacity(a.groups.len());
                    for (g, &m) in a.groups.iter().zip(c) {
                        let k = m << g.bits;
                        models.push(probs[at..at + k].to_vec());
                        at += k;
                    }
                    a.models = models;
                }
            }
            for (i, a) in allocations.iter().enumerate() {
                a.validate(comps, 16).map_err(|e| format!("{n} allocation {i} (ratio {}): {e}", ratios[i]))?;
                if let Some(g) = a.groups.iter().find(|g| blocks.iter().any(|b| g.start < b.components.start as u32 && (b.components.start as u32) < g.start + g.len)) {
                    return Err(format!("{n} allocation {i}: group at {} crosses a basis block", g.start));
                }
            }
            let scale = match st.tensor(&format!("{n}.scale")) {
                Err(_) => Vec::new(),
                Ok(_) if version < 3 => return Err(format!("`{n}.scale` in a version {version} file (a weighted calibration is version 3)")),
                Ok(_) => {
                    let (s, _) = f32s(&format!("{n}.scale"), Some(&[p]))?;
                    if s.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                        return Err(format!("`{n}.scale` must be finite and positive"));
                    }
                    s
                }
            };
            Ok(SideCalib { mean, basis, variance, allocations, blocks, scale })
        };
        let cal = Calibration { layers, kv_heads, head_dim, rope, sinks: num("sinks")?, window: num("window")?, samples: num("samples")?, ratios: ratios.clone(), k: side("k")?, v: side("v")? };
        let id = get("id")?;
        if id != cal.id_hex() {
            return Err(format!("content does not match its id {id} (computed {}): the file was altered", cal.id_hex()));
        }
        Ok(cal)
    }
}
