//! kvtc (seed 003) from Python: save a sequence of a model's caches (one `Cache` per layer)
//! as a compressed container, and load one back, restored on the GPU, into a new sequence.
//!
//! ```python
//! cal = kvforge.KvtcCalibration("calibration.safetensors")   # kvforge calibrate
//! stats = kvforge.kvtc_save(caches, seq, "seq.kvtc", cal, ratio=16)
//! new_seqs = kvforge.kvtc_load(caches, "seq.kvtc", cal, tier="fp16")
//! seq2 = cache.load("one-layer.kvtc", cal)   # a one-layer calibration: Cache.save / Cache.load
//! ```
//!
//! Saving reads the pages back with the f64 reference decoders (kvforge-rt `kvtc::read_sequence`);
//! loading entropy-decodes the chunks on all host threads, restores them on the GPU and appends
//! the rows (staged through the host) into the chosen tier. Either side fails with a
//! `KvforgeError` naming the chunk and leaves nothing behind: a failed save writes no file (a
//! temporary file is renamed at the end), a failed load adds no sequence.

use std::path::PathBuf;

use kvforge_kvtc::{Calibration, Entropy, PackOptions};
use kvforge_rt::kvtc::KvtcRestorer;
use kvforge_rt::{KvCache, RtError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::{bad, guarded, Cache, OrPy};

/// A kvtc calibration file (``kvforge calibrate``), checked on load; the GPU restorer is built
/// on first use (module compile, basis upload) and kept.
///
/// KvtcCalibration(path)
#[pyclass(module = "kvforge", name = "KvtcCalibration", unsendable)]
pub struct KvtcCalibration {
    cal: Calibration,
    restorer: Option<(usize, KvtcRestorer)>,
}

#[pymethods]
impl KvtcCalibration {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let cal = Calibration::load(&path).map_err(RtError::from).or_py(py)?;
        Ok(KvtcCalibration { cal, restorer: None })
    }

    #[getter]
    fn layers(&self) -> usize {
        self.cal.layers
    }
    #[getter]
    fn kv_heads(&self) -> usize {
        self.cal.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.cal.head_dim
    }
    #[getter]
    fn ratios(&self) -> Vec<f64> {
        self.cal.ratios.clone()
    }
    /// The calibration id (hex) containers record.
    #[getter]
    fn id(&self) -> String {
        self.cal.id_hex()
    }
}

/// Mutable borrows of the caches of a list, in order.
fn borrow_caches<'py>(py: Python<'py>, caches: &Bound<'py, PyList>) -> PyResult<Vec<PyRefMut<'py, Cache>>> {
    caches.iter().map(|c| c.extract::<PyRefMut<'py, Cache>>().map_err(|_| bad(py, "caches: a list of kvforge.Cache, each once"))).collect()
}

/// Packs sequence `seq` of `caches` (one ``Cache`` per calibrated layer, in layer order) into
/// the file `path`; returns the sizes (``ratio_total``: fp16 bytes over the file's bytes).
/// ``entropy``: ``"deflate"`` (the paper's), ``"zstd"`` or ``"none"``.
#[pyfunction]
#[pyo3(signature = (caches, seq, path, calibration, ratio = 16.0, entropy = "deflate", chunk_tokens = 256))]
#[allow(clippy::too_many_arguments)]
pub fn kvtc_save<'py>(
    py: Python<'py>,
    caches: &Bound<'py, PyList>,
    #[pyo3(from_py_with = crate::nat)] seq: usize,
    path: PathBuf,
    calibration: &KvtcCalibration,
    #[pyo3(from_py_with = crate::real)] ratio: f64,
    entropy: &str,
    #[pyo3(from_py_with = crate::nat)] chunk_tokens: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let cal = &calibration.cal;
    let ratio_index = cal.ratio_index(ratio).ok_or_else(|| bad(py, format!("ratio {ratio} is not calibrated (ratios {:?})", cal.ratios)))?;
    let entropy = Entropy::parse(entropy).ok_or_else(|| bad(py, format!("entropy `{entropy}`: one of deflate, zstd, rans, none")))?;
    if chunk_tokens == 0 {
        return Err(bad(py, "chunk_tokens must be at least 1"));
    }
    let opts = PackOptions { ratio_index, entropy, chunk_tokens };
    let borrowed = borrow_caches(py, caches)?;
    let stats = guarded(py, || {
        let refs: Vec<&KvCache> = borrowed.iter().map(|c| &c.inner).collect();
        let mut bytes = Vec::new();
        let stats = kvforge_rt::kvtc::save_sequence(&refs, seq, cal, &opts, &mut bytes).or_py(py)?;
        let tmp = path.with_extension("kvtc-partial");
        std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &path)).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            bad(py, format!("{}: {e}", path.display()))
        })?;
        Ok(stats)
    })?;
    let d = PyDict::new(py);
    d.set_item("tokens", stats.tokens)?;
    d.set_item("compressed_tokens", stats.compressed_tokens)?;
    d.set_item("fp16_bytes", stats.fp16_bytes)?;
    d.set_item("total_bytes", stats.total_bytes)?;
    d.set_item("ratio_before_entropy", stats.ratio_before_entropy())?;
    d.set_item("ratio_after_entropy", stats.ratio_after_entropy())?;
    d.set_item("ratio_total", stats.ratio_total())?;
    Ok(d)
}

/// Restores the container `path` (packed with `calibration`) on the GPU into a new sequence of
/// every cache (one per layer, in layer order), full pages in tier `tier` (a name; default:
/// each cache's target tier); returns the new sequence ids. All or nothing.
#[pyfunction]
#[pyo3(signature = (caches, path, calibration, tier = None))]
pub fn kvtc_load(py: Python<'_>, caches: &Bound<'_, PyList>, path: PathBuf, calibration: &mut KvtcCalibration, tier: Option<&str>) -> PyResult<Vec<usize>> {
    let mut borrowed = borrow_caches(py, caches)?;
    let (tier_id, ordinal, dev) = {
        let first = borrowed.first().ok_or_else(|| bad(py, "caches: empty list"))?;
        let tier_id = match tier {
            Some(name) => first.inner.spec().tier(name).map(|t| t.id).ok_or_else(|| bad(py, format!("tier `{name}` is not in spec `{}`", first.inner.spec().name)))?,
            None => first.inner.config().target_tier,
        };
        (tier_id, first.ordinal, first.inner.device().clone())
    };
    guarded(py, || {
        if calibration.restorer.as_ref().is_none_or(|(o, _)| *o != ordinal) {
            calibration.restorer = Some((ordinal, KvtcRestorer::new(&dev, &calibration.cal).or_py(py)?));
        }
        let (_, restorer) = calibration.restorer.as_ref().expect("set above");
        let mut file = std::fs::File::open(&path).map_err(|e| bad(py, format!("{}: {e}", path.display())))?;
        for c in borrowed.iter_mut() {
            c.generation += 1;
        }
        let mut refs: Vec<&mut KvCache> = borrowed.iter_mut().map(|c| &mut c.inner).collect();
        kvforge_rt::kvtc::load_container(&mut refs, &mut std::io::BufReader::new(&mut file), &calibration.cal, restorer, tier_id).or_py(py)
    })
}
