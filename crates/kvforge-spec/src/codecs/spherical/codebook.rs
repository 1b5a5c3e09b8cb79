//! Spherical codebooks: `2^angle_bits` unit vectors in R^group, stored as a safetensors file
//! holding one f32 tensor `codebook` of shape [entries, group]; the file's metadata says how
//! the codebook was trained.

use std::collections::HashMap;
use std::path::Path;

/// Tolerance on ‖c_i‖₂ − 1 for a codeword to count as unit norm.
pub const UNIT_NORM_TOL: f32 = 1e-3;

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
        for (index, row) in data.chunks_exact(group).enumerate() {
            let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
            if !((norm - 1.0).abs() <= UNIT_NORM_TOL) {
                return Err(CodebookError::NotUnit { path, index, norm });
            }
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
}
