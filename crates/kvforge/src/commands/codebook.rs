//! `kvforge codebook train`: spherical k-means on sample vectors.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use kvforge_spec::Codebook;

use crate::exit::{bad_input, ensure};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Train a codebook of 2^angle_bits unit vectors in R^group.
    Train {
        /// Samples: a .safetensors file (first tensor, or --tensor) of shape [n, group] or
        /// [n, head_dim] (split into groups). Omit for uniform random unit vectors.
        #[arg(long)]
        samples: Option<PathBuf>,
        #[arg(long)]
        tensor: Option<String>,
        #[arg(long)]
        group: usize,
        #[arg(long)]
        angle_bits: u32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 30)]
        iters: usize,
        /// Uniform samples to draw when --samples is absent.
        #[arg(long, default_value_t = 16384)]
        uniform: usize,
        #[arg(long, short)]
        out: PathBuf,
    },
}

/// Largest `--samples` file read (bytes).
const MAX_SAMPLES_BYTES: u64 = 4 << 30;

fn load_samples(path: &std::path::Path, tensor: Option<&str>, group: usize) -> anyhow::Result<Vec<f32>> {
    let bytes = kvforge_spec::input::read_limited(path, MAX_SAMPLES_BYTES).map_err(|e| bad_input(format!("--samples {}: {e}", path.display())))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad_input(format!("--samples {}: not a safetensors file: {e}", path.display())))?;
    let name = match tensor {
        Some(t) => t.to_string(),
        None => st.names().into_iter().min().ok_or_else(|| bad_input(format!("--samples {}: no tensors", path.display())))?.to_string(),
    };
    let t = st.tensor(&name).map_err(|e| bad_input(format!("--samples {}: {e}", path.display())))?;
    let data: Vec<f32> = match t.dtype() {
        safetensors::Dtype::F32 => t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        safetensors::Dtype::F16 => t.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        safetensors::Dtype::BF16 => t.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(bad_input(format!("--samples {}: tensor `{name}` is {other:?}; use F32, F16 or BF16", path.display()))),
    };
    let last = *t.shape().last().unwrap_or(&0);
    if last == 0 || last % group != 0 {
        return Err(bad_input(format!("--samples {}: tensor `{name}` has shape {:?}; its last dim must be a multiple of --group {group}", path.display(), t.shape())));
    }
    Ok(data)
}

pub fn run(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Train { samples, tensor, group, angle_bits, seed, iters, uniform, out } => {
            ensure((1..=8).contains(&angle_bits), || format!("--angle-bits {angle_bits}: valid 1 to 8"))?;
            ensure(group > 0 && group % 4 == 0 && group <= 256, || format!("--group {group}: channels per group, a multiple of 4 from 4 to 256 dividing the head dims (e.g. 16, 32)"))?;
            ensure(iters > 0, || "--iters 0: at least 1 k-means iteration".into())?;
            let entries = 1usize << angle_bits;
            ensure(samples.is_some() || uniform >= entries, || format!("--uniform {uniform}: at least as many samples as the {entries} codewords"))?;
            crate::exit::output_path("--out", &out)?;
            let (data, origin) = match &samples {
                Some(p) => (load_samples(p, tensor.as_deref(), group)?, format!("samples from {}", p.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()))),
                None => (kvforge_ref::uniform_unit_samples(uniform, group, seed), "uniform random unit vectors (placeholder until real key data exists)".to_string()),
            };
            let words = kvforge_ref::train_codebook(&data, group, entries, seed, iters);
            let mut meta = HashMap::new();
            meta.insert("trained_on".to_string(), origin);
            meta.insert("method".to_string(), format!("spherical k-means, {iters} iterations"));
            meta.insert("seed".to_string(), seed.to_string());
            meta.insert("samples".to_string(), (data.len() / group).to_string());
            let cb = Codebook::new(out.display().to_string(), entries, group, words, meta);
            cb.save(&out)?;
            println!("wrote {} ({entries} codewords of {group} channels)", out.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}
