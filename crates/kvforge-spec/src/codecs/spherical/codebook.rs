//! Spherical codebooks: `2^angle_bits` unit vectors in R^group, stored as a safetensors file
//! holding one f32 tensor `codebook` of shape [entries, group]; the file's metadata says how
//! the codebook was trained. A spec names one such codebook per tier, copied to every kv head
//! and group; [`HeadCodebooks`] holds one per (layer, kv head, group), trained on a model's
//! captured keys (`kvforge codebook train --per-head`), which a cache takes per layer at run
//! time (`KvCache::set_codebook`).

use std::collections::HashMap;
use std::path::Path;

/// Tolerance on ‖c_i‖₂ − 1 for a codeword to count as unit norm.
pub const UNIT_NORM_TOL: f32 = 1e-3;

/// Metadata key that `kvforge codebook train` sets to `"true"` on a codebook trained on
/// uniform random unit vectors: a placeholder that does not fit any model's keys.
pub const PLACEHOLDER_KEY: &str = "placeholder";

/// Prefix of the `trained_on` metadata of uniform placeholder codebooks (also recognised in
/// files written before [`PLACEHOLDER_KEY`] existed).
pub const UNIFORM_ORIGIN: &str = "uniform random unit vectors";

/// Tensor name of a per-(layer, kv head, group) codebook file.
pub const HEAD_CODEBOOKS_TENSOR: &str = "codebooks";

/// Largest per-head codebook file read (bytes): 80 layers × 8 kv heads × head_dim 256 × 2^8
/// entries of f32 is 160 MiB.
pub const MAX_HEAD_CODEBOOKS_BYTES: u64 = 256 << 20;

#[derive(Clone, Debug)]
pub struct Codebook {
    /// Path as written in the spec (relative to the spec file).
    pub path: String,
    pub entries: usize,
    pub group: usize,
    /// Row-major [entries][group].
    pub data: Vec<f32>,
    pub metadata: HashMap<String, String>,
    /// blake3 of `data`, for cache keys and equality.
    pub hash: String,
}

impl PartialEq for Codebook {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.entries == other.entries && self.group == other.group
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CodebookError {
    #[error("cannot read codebook file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("codebook file {path} is not a safetensors file: {message}")]
    Format { path: String, message: String },
    #[error("codebook file {path} has shape {found:?}, expected [{entries}, {group}] (2^angle_bits entries of group channels)")]
    Shape { path: String, found: Vec<usize>, entries: usize, group: usize },
    #[error("codebook file {path}: codeword {index} has norm {norm:.5}, codewords must be unit vectors (±{UNIT_NORM_TOL})")]
    NotUnit { path: String, index: usize, norm: f32 },
    #[error("codebook file {path}: {message}")]
    Layout { path: String, message: String },
}

/// Whether `metadata` marks a uniform placeholder codebook ([`PLACEHOLDER_KEY`] or a
/// `trained_on` starting with [`UNIFORM_ORIGIN`]).
pub fn is_placeholder(metadata: &HashMap<String, String>) -> bool {
    metadata.get(PLACEHOLDER_KEY).is_some_and(|v| v == "true") || metadata.get("trained_on").is_some_and(|v| v.starts_with(UNIFORM_ORIGIN))
}

/// Checks that every `group`-channel row of `data` is a finite unit vector; returns the first
/// row that is not and its norm.
pub fn first_non_unit(data: &[f32], group: usize) -> Option<(usize, f32)> {
    data.chunks_exact(group).enumerate().find_map(|(i, row)| {
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        (!((norm - 1.0).abs() <= UNIT_NORM_TOL)).then_some((i, norm))
    })
}

impl Codebook {
    pub fn new(path: String, entries: usize, group: usize, data: Vec<f32>, metadata: HashMap<String, String>) -> Codebook {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        let hash = blake3::hash(&bytes).to_hex().to_string();
        Codebook { path, entries, group, data, metadata, hash }
    }

    /// Loads `file` and checks that it holds `entries` unit codewords of `group` channels.
    pub fn load(file: &Path, shown: &str, entries: usize, group: usize) -> Result<Codebook, CodebookError> {
        let path = shown.to_string();
        let io = |source| CodebookError::Io { path: path.clone(), source };
        // Only regular files under a size limit: a device (`/dev/zero`, `/dev/stdin`) would
        // never finish reading.
        let bytes = crate::input::read_limited(file, crate::input::MAX_CODEBOOK_BYTES).map_err(io)?;
        let fmt = |message: String| CodebookError::Format { path: path.clone(), message };
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| fmt(e.to_string()))?;
        let t = st.tensor("codebook").map_err(|e| fmt(format!("{e} (expected a tensor named `codebook`)")))?;
        if t.dtype() != safetensors::Dtype::F32 {
            return Err(fmt(format!("tensor `codebook` is {:?}, expected F32", t.dtype())));
        }
        if t.shape() != [entries, group] {
            return Err(CodebookError::Shape { path, found: t.shape().to_vec(), entries, group });
        }
        let data: Vec<f32> = t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        if let Some((index, norm)) = first_non_unit(&data, group) {
            return Err(CodebookError::NotUnit { path, index, norm });
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| fmt(e.to_string()))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        Ok(Codebook::new(path, entries, group, data, metadata))
    }

    /// Writes the codebook as safetensors with `metadata`.
    pub fn save(&self, file: &Path) -> std::io::Result<()> {
        let bytes: Vec<u8> = self.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![self.entries, self.group], &bytes).map_err(std::io::Error::other)?;
        let out = safetensors::serialize([("codebook", view)], &Some(self.metadata.clone())).map_err(std::io::Error::other)?;
        std::fs::write(file, out)
    }

    /// Codeword `i`.
    pub fn word(&self, i: usize) -> &[f32] {
        &self.data[i * self.group..(i + 1) * self.group]
    }

    /// Whether this is a uniform placeholder (see [`is_placeholder`]).
    pub fn is_placeholder(&self) -> bool {
        is_placeholder(&self.metadata)
    }
}

/// One codebook per (layer, kv head, group): tensor [`HEAD_CODEBOOKS_TENSOR`] (F32) of shape
/// `[layers, kv_heads, head_dim / group, entries, group]`, unit codewords. Layer `l`'s slice
/// ([`HeadCodebooks::layer`], `[kv_heads][groups][entries][group]`) is the layout of a
/// spherical tier's `codebook` side table. Metadata: `trained_on`, `method`, `seed`,
/// `samples` (vectors per codebook), `head_dim`, and `basis` (`identity`, or
/// `hadamard:<seed>` for keys rotated before grouping as the `rotated` scheme rotates them).
#[derive(Clone, Debug, PartialEq)]
pub struct HeadCodebooks {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub group: usize,
    pub entries: usize,
    /// Row-major `[layers][kv_heads][groups][entries][group]`.
    pub data: Vec<f32>,
    pub metadata: HashMap<String, String>,
}

impl HeadCodebooks {
    /// Groups per head.
    pub fn groups(&self) -> usize {
        self.head_dim / self.group
    }

    /// Floats per layer: `kv_heads × groups × entries × group`.
    pub fn layer_len(&self) -> usize {
        self.kv_heads * self.head_dim * self.entries
    }

    /// Layer `l`'s codebooks `[kv_heads][groups][entries][group]`, if the file has that layer.
    pub fn layer(&self, l: usize) -> Option<&[f32]> {
        (l < self.layers).then(|| &self.data[l * self.layer_len()..(l + 1) * self.layer_len()])
    }

    /// The basis the codebooks were trained in (`identity` when the metadata does not say).
    pub fn basis(&self) -> &str {
        self.metadata.get("basis").map_or("identity", String::as_str)
    }

    /// Loads a file written by [`HeadCodebooks::save`], checking its shape and unit rows.
    pub fn load(file: &Path, shown: &str) -> Result<HeadCodebooks, CodebookError> {
        let path = shown.to_string();
        let bytes = crate::input::read_limited(file, MAX_HEAD_CODEBOOKS_BYTES).map_err(|source| CodebookError::Io { path: path.clone(), source })?;
        let fmt = |message: String| CodebookError::Format { path: path.clone(), message };
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| fmt(e.to_string()))?;
        let t = st.tensor(HEAD_CODEBOOKS_TENSOR).map_err(|e| fmt(format!("{e} (expected a tensor named `{HEAD_CODEBOOKS_TENSOR}`, as `kvforge codebook train --per-head` writes)")))?;
        if t.dtype() != safetensors::Dtype::F32 {
            return Err(fmt(format!("tensor `{HEAD_CODEBOOKS_TENSOR}` is {:?}, expected F32", t.dtype())));
        }
        let &[layers, kv_heads, groups, entries, group] = t.shape() else {
            return Err(CodebookError::Layout { path, message: format!("tensor `{HEAD_CODEBOOKS_TENSOR}` has shape {:?}, expected [layers, kv_heads, head_dim/group, entries, group]", t.shape()) });
        };
        if layers == 0 || kv_heads == 0 || groups == 0 || group == 0 || !entries.is_power_of_two() || !(2..=256).contains(&entries) {
            return Err(CodebookError::Layout { path, message: format!("shape {:?}: every dim must be positive and entries a power of two from 2 to 256", t.shape()) });
        }
        let data: Vec<f32> = t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        if let Some((index, norm)) = first_non_unit(&data, group) {
            return Err(CodebookError::NotUnit { path, index, norm });
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| fmt(e.to_string()))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        Ok(HeadCodebooks { layers, kv_heads, head_dim: groups * group, group, entries, data, metadata })
    }

    /// Writes the codebooks as safetensors with their metadata.
    pub fn save(&self, file: &Path) -> std::io::Result<()> {
        let bytes: Vec<u8> = self.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        let shape = vec![self.layers, self.kv_heads, self.groups(), self.entries, self.group];
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &bytes).map_err(std::io::Error::other)?;
        let out = safetensors::serialize([(HEAD_CODEBOOKS_TENSOR, view)], &Some(self.metadata.clone())).map_err(std::io::Error::other)?;
        std::fs::write(file, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn placeholder_is_recognised_by_flag_or_origin() {
        assert!(is_placeholder(&meta(&[(PLACEHOLDER_KEY, "true")])));
        assert!(is_placeholder(&meta(&[("trained_on", "uniform random unit vectors (placeholder until real key data exists)")])));
        assert!(!is_placeholder(&meta(&[("trained_on", "samples from keys-emma.safetensors")])));
        assert!(!is_placeholder(&HashMap::new()));
    }

    #[test]
    fn head_codebooks_round_trip_and_slice_by_layer() {
        let (layers, kv_heads, head_dim, group, entries) = (2, 3, 8, 4, 2);
        let n = layers * kv_heads * head_dim * entries;
        let data: Vec<f32> = (0..n).map(|i| if i % group == (i / group) % group { 1.0 } else { 0.0 }).collect();
        let cb = HeadCodebooks { layers, kv_heads, head_dim, group, entries, data, metadata: meta(&[("basis", "hadamard:0x5eed")]) };
        let dir = std::env::temp_dir().join(format!("kvforge-headcb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("cb.safetensors");
        cb.save(&f).unwrap();
        let back = HeadCodebooks::load(&f, "cb.safetensors").unwrap();
        assert_eq!(back, cb);
        assert_eq!(back.layer(1).unwrap(), &cb.data[cb.layer_len()..]);
        assert!(back.layer(2).is_none());
        assert_eq!(back.basis(), "hadamard:0x5eed");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn head_codebooks_refuse_non_unit_rows_and_wrong_rank() {
        let dir = std::env::temp_dir().join(format!("kvforge-headcb-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("bad.safetensors");
        let cb = HeadCodebooks { layers: 1, kv_heads: 1, head_dim: 4, group: 4, entries: 2, data: vec![0.4; 8], metadata: HashMap::new() };
        cb.save(&f).unwrap();
        assert!(matches!(HeadCodebooks::load(&f, "bad"), Err(CodebookError::NotUnit { index: 0, .. })));
        let one = Codebook::new("x".into(), 2, 4, vec![1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], HashMap::new());
        one.save(&f).unwrap();
        assert!(matches!(HeadCodebooks::load(&f, "bad"), Err(CodebookError::Format { .. })));
        std::fs::remove_dir_all(&dir).ok();
    }
}
