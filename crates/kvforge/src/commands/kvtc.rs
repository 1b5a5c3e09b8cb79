//! `kvforge calibrate`, `kvforge pack`, `kvforge unpack`: kvtc, the storage codec
//! (crates/kvforge-kvtc, docs/kvtc.md).

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use kvforge_kvtc::{calibrate_grid, pack_into, unpack_from, CalibConfig, Calibration, DpConfig, Entropy, KvDump, KvtcError, PackOptions, Rope};

use crate::exit::{bad_input, ensure, output_path};

#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// K/V dump (.safetensors): `k.L00`.. / `v.L00`.. of shape [kv_heads, tokens, head_dim]
    /// and optionally `positions` [tokens] (benches/quality/capture_keys.py writes
    /// data/keys/kv-emma-per-layer.safetensors).
    #[arg(long)]
    pub samples: PathBuf,
    /// Calibration file to write (.safetensors).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Compression ratios vs fp16 (before entropy coding) to allocate bits for.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,64")]
    pub ratios: Vec<f64>,
    /// Leading tokens of each sequence kept in fp16 (attention sinks).
    #[arg(long, default_value_t = 4)]
    pub sinks: usize,
    /// Trailing tokens of each sequence kept in fp16 (the recent window).
    #[arg(long, default_value_t = 128)]
    pub window: usize,
    /// Most token positions sampled for the PCA.
    #[arg(long, default_value_t = 16384)]
    pub max_samples: usize,
    /// Positions the bit-allocation DP measures errors on. Several (comma-separated), or several
    /// --key-share values, calibrate a grid with one PCA: one file per point, named
    /// `<out stem>-ks<share>-dp<rows>.<ext>`.
    #[arg(long, value_delimiter = ',', default_value = "256")]
    pub dp_rows: Vec<usize>,
    /// Most principal components kept (default: all; per basis block).
    #[arg(long)]
    pub max_rank: Option<usize>,
    /// Layers sharing one basis: 0 (default) one PCA over all layers; n: one per run of n
    /// layers (block-diagonal basis, fewer restore FLOPs).
    #[arg(long, default_value_t = 0)]
    pub layers_per_basis: usize,
    /// The model's RoPE base (`rope_theta`; SmolLM2: 100000), undone on keys before the PCA.
    /// Default: the dump's `rope_theta` metadata.
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Channels RoPE rotates (`rope_dim`; default: the dump's metadata, else head_dim).
    #[arg(long)]
    pub rope_dim: Option<usize>,
    /// Take keys as they are (no RoPE to undo).
    #[arg(long, conflicts_with = "rope_theta")]
    pub no_rope: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Feature weights (.safetensors): `k.weight` and/or `v.weight` of shape [layers, kv_heads,
    /// head_dim], the importance of each feature's squared error (capture_keys.py writes
    /// kv-emma-weights.safetensors: mean query energy per key channel pair, o_proj column
    /// energy per value channel). The PCA and the DP then minimise the weighted error; the
    /// file is version 3.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Share of keys in the joint bit budget of keys and values (0.5: equal); several
    /// (comma-separated) calibrate a grid (see --dp-rows).
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    pub key_share: Vec<f64>,
    /// Allocate for the `rans` coder: the budget counts each group's estimated entropy-coded
    /// size, widths may use the min/max range, and every group carries its code model, so the
    /// ratios are ratios after entropy coding (pack with `--entropy rans`). The file is version 4.
    #[arg(long)]
    pub coded: bool,
    /// Step allocations for the `rans` coder: one quantisation step per side and ratio with a
    /// code model per principal component (entropy-constrained quantisation, no per-token
    /// scales), the smallest step whose expected coded size fits each ratio; ratios are after
    /// entropy coding (pack with `--entropy rans`). Takes the place of the DP; version 4.
    #[arg(long, conflicts_with = "coded")]
    pub step: bool,
    /// With `--step`: the encoder's dead zone in steps (0 ≤ d < 0.5; 0: round to nearest).
    /// Rounding thresholds sit `d` steps further from zero than the midpoints, so values near
    /// one fall to the likelier code nearer zero: fewer coded bits for a little error; the
    /// models and the step are fitted to it. Only the encoder reads it.
    #[arg(long, default_value_t = 0.0, requires = "step")]
    pub dead_zone: f32,
    /// Share of the sampled positions kept out of the PCA (0 ≤ h < 1; 0: none): the
    /// allocation's rows and, with `--step`, each component's variance come from them, so the
    /// plan is what a token the basis did not see costs (the PCA's trailing variances are
    /// biased low).
    #[arg(long, default_value_t = 0.0)]
    pub holdout: f64,
}

#[derive(clap::Args)]
pub struct PackArgs {
    /// Cache dump to compress (.safetensors, the layout `calibrate --samples` reads).
    pub input: PathBuf,
    /// Calibration file (`kvforge calibrate`).
    #[arg(long)]
    pub calibration: PathBuf,
    /// Compression ratio: one of the calibration's.
    #[arg(long)]
    pub ratio: f64,
    /// Lossless stage: deflate (the paper's), zstd, rans (per-group code models; needs a
    /// `calibrate --coded` calibration) or none.
    #[arg(long, default_value = "deflate")]
    pub entropy: String,
    /// Compressed tokens per chunk.
    #[arg(long, default_value_t = 256)]
    pub chunk_tokens: usize,
    /// Container to write (.kvtc).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Also write the sizes as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct UnpackArgs {
    /// Container (`kvforge pack`).
    pub input: PathBuf,
    /// The calibration it was packed with.
    #[arg(long)]
    pub calibration: PathBuf,
    /// Restored cache dump to write (.safetensors, F16).
    #[arg(long, short)]
    pub out: PathBuf,
}

/// Errors about the user's files and arguments exit 2, the rest 1.
fn classify(e: KvtcError) -> anyhow::Error {
    match e {
        KvtcError::Stream(_) | KvtcError::Linalg(_) => e.into(),
        e => bad_input(e.to_string()),
    }
}

/// Writes through a temporary file beside `path`, renamed into place only on success.
fn write_atomically(path: &Path, f: impl FnOnce(&Path) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    match f(&tmp) {
        Ok(()) => std::fs::rename(&tmp, path).map_err(|e| anyhow::anyhow!("renaming {} to {}: {e}", tmp.display(), path.display())),
        Err(e) => {
            std::fs::remove_file(&tmp).ok();
            Err(e)
        }
    }
}

pub fn calibrate_cmd(a: CalibrateArgs) -> anyhow::Result<ExitCode> {
    output_path("--out", &a.out)?;
    ensure(!a.ratios.is_empty() && a.ratios.iter().all(|&r| r >= 1.0), || format!("--ratios {:?}: each must be ≥ 1", a.ratios))?;
    let (dump, meta) = KvDump::load_with_metadata(&a.samples).map_err(classify)?;
    let meta_num = |k: &str| meta.get(k).and_then(|v| v.parse::<f64>().ok());
    let rope = if a.no_rope {
        None
    } else {
        let theta = a
            .rope_theta
            .or_else(|| meta_num("rope_theta"))
            .ok_or_else(|| bad_input(format!("{}: no `rope_theta` metadata; pass --rope-theta (the model's rope_theta, SmolLM2: 100000) or --no-rope", a.samples.display())))?;
        let dim = a.rope_dim.or_else(|| meta_num("rope_dim").map(|d| d as usize)).unwrap_or(dump.head_dim);
        ensure(dim.is_multiple_of(2) && dim <= dump.head_dim && dim > 0, || format!("--rope-dim {dim}: must be even and ≤ head_dim {}", dump.head_dim))?;
        Some(Rope { theta, dim })
    };
    let weights = match &a.weights {
        None => [None, None],
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|e| bad_input(format!("{}: {e}", path.display())))?;
            let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad_input(format!("{}: {e}", path.display())))?;
            let shape = [dump.layers, dump.kv_heads, dump.head_dim];
            let side = |name: &str| -> anyhow::Result<Option<Vec<f64>>> {
                let Ok(t) = st.tensor(name) else { return Ok(None) };
                ensure(t.dtype() == safetensors::Dtype::F32 && t.shape() == shape, || format!("{}: `{name}` must be F32 {shape:?}, is {:?} {:?}", path.display(), t.dtype(), t.shape()))?;
                Ok(Some(t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect()))
            };
            let w = [side("k.weight")?, side("v.weight")?];
            ensure(w.iter().any(Option::is_some), || format!("{}: neither `k.weight` nor `v.weight`", path.display()))?;
            w
        }
    };
    ensure(!a.key_share.is_empty() && a.key_share.iter().all(|&k| k > 0.0 && k < 1.0), || format!("--key-share {:?}: each must lie strictly between 0 and 1", a.key_share))?;
    ensure((0.0..1.0).contains(&a.holdout), || format!("--holdout {}: must lie in [0, 1)", a.holdout))?;
    ensure((0.0..0.5).contains(&a.dead_zone), || format!("--dead-zone {}: must lie in [0, 0.5)", a.dead_zone))?;
    ensure(!a.dp_rows.is_empty() && a.dp_rows.iter().all(|&r| r > 0), || format!("--dp-rows {:?}: each must be > 0", a.dp_rows))?;
    let cfg = CalibConfig {
        weights,
        key_share: a.key_share[0],
        sinks: a.sinks,
        window: a.window,
        max_samples: a.max_samples,
        dp_rows: a.dp_rows[0],
        max_rank: a.max_rank.unwrap_or(usize::MAX),
        ratios: a.ratios.clone(),
        rope,
        seed: a.seed,
        layers_per_basis: a.layers_per_basis,
        dp: DpConfig { coded: a.coded, ..DpConfig::default() },
        step: a.step,
        dead_zone: a.dead_zone,
        holdout: a.holdout,
    };
    eprintln!(
        "{}: {} layers × {} kv heads × head_dim {} = {} features, {} tokens; RoPE {}",
        a.samples.display(),
        dump.layers,
        dump.kv_heads,
        dump.head_dim,
        dump.features(),
        dump.tokens,
        rope.map_or("none".into(), |r| format!("theta {} over {} channels (undone on keys)", r.theta, r.dim))
    );
    let bar = indicatif::ProgressBar::new(6);
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}").unwrap());
    let t0 = Instant::now();
    let mut steps: Vec<(String, Instant)> = Vec::new();
    let cals = calibrate_grid(&dump, &cfg, &a.key_share, &a.dp_rows, |step| {
        bar.inc(1);
        bar.set_message(step.to_string());
        steps.push((step.to_string(), Instant::now()));
    })
    .map_err(classify)?;
    bar.finish_and_clear();
    let end = Instant::now();
    for (i, (step, at)) in steps.iter().enumerate() {
        let next = steps.get(i + 1).map_or(end, |s| s.1);
        eprintln!("  {:>7.1}s  {step}", (next - *at).as_secs_f64());
    }
    let mut extra = HashMap::new();
    extra.insert("source".into(), a.samples.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
    if let Some(m) = meta.get("model") {
        extra.insert("model".into(), m.clone());
    }
    let grid = cals.len() > 1;
    let points = a.dp_rows.iter().flat_map(|&r| a.key_share.iter().map(move |&k| (k, r)));
    for (cal, (ks, rows)) in cals.iter().zip(points) {
        let out = if grid { grid_path(&a.out, ks, rows) } else { a.out.clone() };
        extra.insert("key_share".into(), ks.to_string());
        extra.insert("dp_rows".into(), rows.to_string());
        write_atomically(&out, |tmp| cal.save(tmp, &extra).map_err(classify))?;
        println!("calibration {} (key share {ks}, {rows} DP rows, {} samples, {:.1}s) -> {}", &cal.id_hex()[..16], cal.samples, t0.elapsed().as_secs_f64(), out.display());
        for (i, r) in cal.ratios.iter().enumerate() {
            for (name, s) in [("keys", &cal.k), ("values", &cal.v)] {
                let al = &s.allocations[i];
                let var: f64 = s.variance.iter().map(|&v| v as f64).sum();
                let coded = if al.coded() { format!(" ({:.0} packed)", al.cost_bits()) } else { String::new() };
                println!(
                    "  {r:>5}x {name:<6}: {:>6} bits/token{coded} of {:>6}, {:>4} groups over {:>5} components, expected error {:.4} of {:.4} (kept variance)",
                    if al.coded() { al.expected_coded_bits().round() as u64 } else { al.cost_bits() },
                    al.budget_bits,
                    al.groups.len(),
                    al.used_components(),
                    al.expected_error,
                    var
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// File of one grid point: `<stem>-ks<share>-dp<rows>.<ext>` beside `out`.
pub fn grid_path(out: &Path, key_share: f64, dp_rows: usize) -> PathBuf {
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match out.extension() {
        Some(e) => format!("{stem}-ks{key_share}-dp{dp_rows}.{}", e.to_string_lossy()),
        None => format!("{stem}-ks{key_share}-dp{dp_rows}"),
    };
    out.with_file_name(name)
}

pub fn pack_cmd(a: PackArgs) -> anyhow::Result<ExitCode> {
    output_path("--out", &a.out)?;
    let entropy = Entropy::parse(&a.entropy).ok_or_else(|| bad_input(format!("--entropy {}: expected deflate, zstd, rans or none", a.entropy)))?;
    ensure(a.chunk_tokens > 0, || "--chunk-tokens must be > 0".into())?;
    let cal = Calibration::load(&a.calibration).map_err(classify)?;
    let ratio_index = cal.ratio_index(a.ratio).ok_or_else(|| bad_input(format!("--ratio {}: {} has ratios {:?}", a.ratio, a.calibration.display(), cal.ratios)))?;
    let dump = KvDump::load(&a.input).map_err(classify)?;
    let t0 = Instant::now();
    let mut stats = None;
    write_atomically(&a.out, |tmp| {
        let f = std::fs::File::create(tmp).map_err(|e| bad_input(format!("--out {}: {e}", tmp.display())))?;
        let mut w = BufWriter::new(f);
        stats = Some(pack_into(&dump, &cal, &PackOptions { ratio_index, entropy, chunk_tokens: a.chunk_tokens }, &mut w).map_err(classify)?);
        w.flush()?;
        Ok(())
    })?;
    let s = stats.expect("set on success");
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{} tokens ({} compressed, {} kept fp16): {} B fp16 -> {} B ({:.2}x overall); compressed tokens {:.2}x before {}, {:.2}x after; {:.2}s -> {}",
        s.tokens,
        s.compressed_tokens,
        s.tokens - s.compressed_tokens,
        s.fp16_bytes,
        s.total_bytes,
        s.ratio_total(),
        s.ratio_before_entropy(),
        entropy.name(),
        s.ratio_after_entropy(),
        secs,
        a.out.display()
    );
    if let Some(j) = a.json {
        let heads = (dump.layers * dump.kv_heads) as f64;
        let json = format!(
            "{{\"tokens\": {}, \"compressed_tokens\": {}, \"fp16_bytes\": {}, \"total_bytes\": {}, \"coded_raw_bytes\": {}, \"coded_stored_bytes\": {}, \"kept_stored_bytes\": {}, \"ratio_before_entropy\": {}, \"ratio_after_entropy\": {}, \"ratio_total\": {}, \"bytes_per_token_per_kv_head\": {}, \"entropy\": \"{}\", \"ratio\": {}, \"calibration\": \"{}\", \"seconds\": {}}}\n",
            s.tokens,
            s.compressed_tokens,
            s.fp16_bytes,
            s.total_bytes,
            s.coded_raw_bytes,
            s.coded_stored_bytes,
            s.kept_stored_bytes,
            s.ratio_before_entropy(),
            s.ratio_after_entropy(),
            s.ratio_total(),
            s.total_bytes as f64 / (s.tokens.max(1) as f64 * heads),
            entropy.name(),
            cal.ratios[ratio_index],
            cal.id_hex(),
            secs
        );
        std::fs::write(&j, json).map_err(|e| bad_input(format!("--json {}: {e}", j.display())))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub fn unpack_cmd(a: UnpackArgs) -> anyhow::Result<ExitCode> {
    output_path("--out", &a.out)?;
    let cal = Calibration::load(&a.calibration).map_err(classify)?;
    let f = std::fs::File::open(&a.input).map_err(|e| bad_input(format!("{}: {e}", a.input.display())))?;
    let t0 = Instant::now();
    let dump = unpack_from(&mut BufReader::new(f), &cal).map_err(|e| classify(e).context(format!("unpacking {}", a.input.display())))?;
    let mut meta = HashMap::new();
    meta.insert("what".into(), "kvtc-restored cache".into());
    meta.insert("calibration".into(), cal.id_hex());
    write_atomically(&a.out, |tmp| dump.save(tmp, meta).map_err(classify))?;
    println!("{} tokens × {} layers × {} kv heads restored in {:.2}s -> {}", dump.tokens, dump.layers, dump.kv_heads, t0.elapsed().as_secs_f64(), a.out.display());
    Ok(ExitCode::SUCCESS)
}
