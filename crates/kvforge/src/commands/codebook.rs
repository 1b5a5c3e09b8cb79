//! `kvforge codebook train`: spherical k-means on sample vectors, either one codebook for a
//! spec's tier or (`--per-head`) one per (layer, kv head, group) from captured keys.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;

use kvforge_spec::codecs::rotated::hadamard;
use kvforge_spec::codecs::spherical::codebook::{HeadCodebooks, PLACEHOLDER_KEY, UNIFORM_ORIGIN};
use kvforge_spec::Codebook;

use crate::exit::{bad_input, ensure};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Train a codebook of 2^angle_bits unit vectors in R^group.
    ///
    /// With --per-head: one codebook per (layer, kv head, group) from captured keys
    /// (benches/quality/capture_keys.py), written as tensor `codebooks` [layers, kv_heads,
    /// head_dim/group, 2^angle_bits, group] (F32) for `KvCache::set_codebook` /
    /// `kvforge.hf` (`codebooks=`).
    Train {
        /// Samples: a .safetensors file (first tensor, or --tensor) of shape [n, group] or
        /// [n, head_dim] (split into groups). Omit for uniform random unit vectors (a
        /// placeholder: the file's metadata says so and kvforge warns when it codes keys).
        /// With --per-head: tensors `k.L00`, `k.L01`, ... of shape [kv_heads, tokens,
        /// head_dim] (capture_keys.py's kv-*-per-layer file), or one tensor [layers × kv_heads
        /// × tokens, head_dim] with metadata `layers` and `kv_heads` (its keys-* file).
        #[arg(long)]
        samples: Option<PathBuf>,
        /// One codebook per (layer, kv head, group) instead of one shared by all.
        #[arg(long, requires = "samples")]
        per_head: bool,
        /// With --per-head: rotate every key by the random-sign Hadamard rotation of this
        /// seed before grouping (the `rotated` scheme's basis; 0x5EED is its default).
        #[arg(long, requires = "per_head", value_parser = parse_u32)]
        rotate_seed: Option<u32>,
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

fn parse_u32(s: &str) -> Result<u32, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("{s}: not a u32 ({e})"))
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

/// Keys per layer, `[kv_heads][tokens][head_dim]` each, from a capture file.
struct Captured {
    layers: Vec<Vec<f32>>,
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
}

fn to_f32(t: &safetensors::tensor::TensorView<'_>, what: &str) -> anyhow::Result<Vec<f32>> {
    Ok(match t.dtype() {
        safetensors::Dtype::F32 => t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        safetensors::Dtype::F16 => t.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        safetensors::Dtype::BF16 => t.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(bad_input(format!("{what} is {other:?}; use F32, F16 or BF16"))),
    })
}

fn load_captured(path: &std::path::Path, tensor: Option<&str>) -> anyhow::Result<Captured> {
    let shown = path.display();
    let bytes = kvforge_spec::input::read_limited(path, MAX_SAMPLES_BYTES).map_err(|e| bad_input(format!("--samples {shown}: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad_input(format!("--samples {shown}: not a safetensors file: {e}")))?;
    let mut per_layer: Vec<String> = st.names().into_iter().filter(|n| n.starts_with("k.L")).cloned().collect();
    per_layer.sort();
    if tensor.is_none() && !per_layer.is_empty() {
        let mut layers = Vec::new();
        let mut shape = None;
        for name in &per_layer {
            let t = st.tensor(name).map_err(|e| bad_input(format!("--samples {shown}: {e}")))?;
            let &[h, n, d] = t.shape() else { return Err(bad_input(format!("--samples {shown}: tensor `{name}` has shape {:?}, expected [kv_heads, tokens, head_dim]", t.shape()))) };
            if shape.is_some_and(|s| s != (h, n, d)) {
                return Err(bad_input(format!("--samples {shown}: tensor `{name}` has shape {:?}, unlike the layers before it {:?}", t.shape(), shape.unwrap())));
            }
            shape = Some((h, n, d));
            layers.push(to_f32(&t, &format!("--samples {shown}: tensor `{name}`"))?);
        }
        let (kv_heads, tokens, head_dim) = shape.expect("at least one layer");
        return Ok(Captured { layers, kv_heads, tokens, head_dim });
    }
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad_input(format!("--samples {shown}: {e}")))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let name = match tensor {
        Some(t) => t.to_string(),
        None => st.names().into_iter().min().ok_or_else(|| bad_input(format!("--samples {shown}: no tensors")))?.to_string(),
    };
    let t = st.tensor(&name).map_err(|e| bad_input(format!("--samples {shown}: {e}")))?;
    let num = |k: &str| meta.get(k).and_then(|v| v.parse::<usize>().ok()).filter(|&v| v > 0);
    let (Some(nl), Some(kv_heads), &[rows, head_dim]) = (num("layers"), num("kv_heads"), t.shape()) else {
        return Err(bad_input(format!(
            "--samples {shown}: --per-head needs tensors `k.L00`.. [kv_heads, tokens, head_dim], or one tensor [layers*kv_heads*tokens, head_dim] with metadata `layers` and `kv_heads` (tensor `{name}` has shape {:?})",
            t.shape()
        )));
    };
    if rows % (nl * kv_heads) != 0 {
        return Err(bad_input(format!("--samples {shown}: {rows} rows are not layers {nl} × kv_heads {kv_heads} × tokens")));
    }
    let all = to_f32(&t, &format!("--samples {shown}: tensor `{name}`"))?;
    let per = all.len() / nl;
    Ok(Captured { layers: all.chunks_exact(per).map(<[f32]>::to_vec).collect(), kv_heads, tokens: rows / (nl * kv_heads), head_dim })
}

struct PerHead {
    group: usize,
    angle_bits: u32,
    seed: u64,
    iters: usize,
    rotate_seed: Option<u32>,
}

fn train_per_head(samples: &std::path::Path, tensor: Option<&str>, o: &PerHead, out: &std::path::Path) -> anyhow::Result<ExitCode> {
    let mut cap = load_captured(samples, tensor)?;
    let (hkv, n, d, g) = (cap.kv_heads, cap.tokens, cap.head_dim, o.group);
    ensure(d % g == 0, || format!("--group {g} does not divide the captured head_dim {d}"))?;
    if let Some(seed) = o.rotate_seed {
        ensure(hadamard::rotatable(d), || format!("--rotate-seed: head_dim {d} is not a power of two"))?;
        cap.layers.iter_mut().for_each(|l| hadamard::rotate_rows(seed, d, l));
    }
    let (entries, ng) = (1usize << o.angle_bits, d / g);
    let mut data = Vec::with_capacity(cap.layers.len() * hkv * d * entries);
    let mut group_samples = vec![0f32; n * g];
    for (l, keys) in cap.layers.iter().enumerate() {
        for h in 0..hkv {
            for j in 0..ng {
                for t in 0..n {
                    group_samples[t * g..(t + 1) * g].copy_from_slice(&keys[(h * n + t) * d + j * g..][..g]);
                }
                let index = ((l * hkv + h) * ng + j) as u64;
                data.extend(kvforge_ref::train_codebook(&group_samples, g, entries, o.seed.wrapping_add(index), o.iters));
            }
        }
        eprintln!("layer {l}: {hkv} kv heads × {ng} groups trained");
    }
    let name = samples.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned());
    let mut metadata = HashMap::new();
    metadata.insert("trained_on".to_string(), format!("samples from {name}, per (layer, kv head, group)"));
    metadata.insert("method".to_string(), format!("spherical k-means, {} iterations, seed + codebook index", o.iters));
    metadata.insert("seed".to_string(), o.seed.to_string());
    metadata.insert("samples".to_string(), n.to_string());
    metadata.insert("head_dim".to_string(), d.to_string());
    metadata.insert("basis".to_string(), o.rotate_seed.map_or("identity".to_string(), |s| format!("hadamard:{s:#x}")));
    let cb = HeadCodebooks { layers: cap.layers.len(), kv_heads: hkv, head_dim: d, group: g, entries, data, metadata };
    cb.save(out)?;
    println!("wrote {} ({} layers × {hkv} kv heads × {ng} groups of {entries} codewords of {g} channels)", out.display(), cb.layers);
    Ok(ExitCode::SUCCESS)
}

pub fn run(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Train { samples, per_head, rotate_seed, tensor, group, angle_bits, seed, iters, uniform, out } => {
            ensure((1..=8).contains(&angle_bits), || format!("--angle-bits {angle_bits}: valid 1 to 8"))?;
            ensure(group > 0 && group % 4 == 0 && group <= 256, || format!("--group {group}: channels per group, a multiple of 4 from 4 to 256 dividing the head dims (e.g. 16, 32)"))?;
            ensure(iters > 0, || "--iters 0: at least 1 k-means iteration".into())?;
            let entries = 1usize << angle_bits;
            ensure(samples.is_some() || uniform >= entries, || format!("--uniform {uniform}: at least as many samples as the {entries} codewords"))?;
            crate::exit::output_path("--out", &out)?;
            if let (true, Some(p)) = (per_head, &samples) {
                return train_per_head(p, tensor.as_deref(), &PerHead { group, angle_bits, seed, iters, rotate_seed }, &out);
            }
            let (data, origin) = match &samples {
                Some(p) => (load_samples(p, tensor.as_deref(), group)?, format!("samples from {}", p.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()))),
                None => (kvforge_ref::uniform_unit_samples(uniform, group, seed), format!("{UNIFORM_ORIGIN} (placeholder until real key data exists)")),
            };
            let words = kvforge_ref::train_codebook(&data, group, entries, seed, iters);
            let mut meta = HashMap::new();
            meta.insert("trained_on".to_string(), origin);
            meta.insert("method".to_string(), format!("spherical k-means, {iters} iterations"));
            meta.insert("seed".to_string(), seed.to_string());
            meta.insert("samples".to_string(), (data.len() / group).to_string());
            if samples.is_none() {
                meta.insert(PLACEHOLDER_KEY.to_string(), "true".to_string());
            }
            let cb = Codebook::new(out.display().to_string(), entries, group, words, meta);
            cb.save(&out)?;
            println!("wrote {} ({entries} codewords of {group} channels)", out.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use kvforge_spec::codecs::rotated::hadamard;

    #[test]
    fn rotation_is_orthogonal_hadamard_with_the_contract_signs() {
        // R = H·diag(s)/√d: e_c maps to s_c × column c of H / √d, whose first entry is
        // s_c/√d. The signs of seed 0x5EED at d = 8 (as benches/quality/sph.py's `signs`).
        let d = 8;
        let signs = [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0];
        let mut cols = Vec::new();
        for (c, s) in signs.iter().enumerate() {
            let mut e = vec![0f32; d];
            e[c] = 1.0;
            hadamard::rotate(0x5EED, &mut e);
            assert!((e.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-6);
            assert!((e[0] - s / (d as f32).sqrt()).abs() < 1e-6, "channel {c}");
            cols.push(e);
        }
        for a in 0..d {
            for b in a + 1..d {
                assert!(cols[a].iter().zip(&cols[b]).map(|(x, y)| x * y).sum::<f32>().abs() < 1e-6);
            }
        }
    }
}
