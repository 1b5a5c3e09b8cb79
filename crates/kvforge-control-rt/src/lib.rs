//! # kvforge-control-rt: the controllers on the GPU cache
//!
//! `kvforge-control` decides which tier each page lives in and sees a cache only through
//! `PagedCache` (which `KvCache` implements in kvforge-rt), so plans apply to a `KvCache` with
//! `kvforge_control::runtime::apply` directly. What needs the cache's own calls lives here:
//!
//! * [`RollCache::roll_cache`]: takes the importance window the GPU kept
//!   (`KvCache::decode_tracked`) and rolls it into a [`PagedImportance`];
//! * [`OfCache::of_cache`]: the positions a `KvCache` records, as a [`PositionMap`];
//! * [`InvokeCache::invoke_cache`] and [`invoke_all`]: an [`RdrPipeline`] boundary with the
//!   window taken from the GPU (the rows' shares computed on the planner thread).
//!
//! One decode loop with RDR:
//!
//! ```no_run
//! # use kvforge_control::*;
//! # use kvforge_control_rt::RollCache;
//! # fn demo(cache: &mut kvforge_rt::KvCache, seq: usize, q: &[f32]) -> Result<(), Box<dyn std::error::Error>> {
//! let spec = cache.spec().clone();
//! let costs = TierCosts::from_spec(&spec, cache.config().head_dim, CostModel::Resident);
//! let limits = Limits { budget: Budget::PerToken(160.0), protection: Protection::default() };
//! let mut rdr = RdrController::new(&spec);
//! let mut importance = PagedImportance::new(0.5, spec.page.tokens)?;
//! let mut pos = runtime::PositionMap::new(seq, cache.config().num_kv_heads);
//! // every decode step, after appending the new token: on the steps RDR samples (one in
//! // `rdr.sample`) the GPU keeps each page's largest share of attention since the last
//! // invocation; the other steps run the plain decode.
//! let out = if rdr.tracks() { cache.decode_tracked(&[seq], q)? } else { cache.decode(&[seq], q)? };
//! if rdr.step() {
//!     importance.roll_cache(cache, seq)?;
//!     pos.sync(cache)?;
//!     let view = pos.view(cache, costs.clone(), |key, _| runtime::Signal { mass: importance.get(key), ..Default::default() })?;
//!     let plan = rdr.decide(&view, &limits);
//!     pos.apply(cache, &view, &plan, &limits)?;
//! }
//! # Ok(()) }
//! ```

use std::time::Instant;

use kvforge_control::pipeline::{invoke_all_deferred, Boundary, DeferredWindow, RdrPipeline};
use kvforge_control::runtime::{ControlError, PositionMap};
use kvforge_control::PagedImportance;
use kvforge_rt::{KvCache, RtError};
use kvforge_spec::TierId;

fn cache_err(e: RtError) -> ControlError {
    ControlError::Cache { total: 0, source: Box::new(e) }
}

/// [`PagedImportance`] fed from the window a `KvCache` keeps on the GPU.
pub trait RollCache {
    /// Takes the device window of `seq` (`KvCache::take_mass_window`, which resets it) and
    /// rolls it in, with the pages' logical positions as the cache records them.
    fn roll_cache(&mut self, cache: &mut KvCache, seq: usize) -> Result<(), ControlError>;
}

impl RollCache for PagedImportance {
    fn roll_cache(&mut self, cache: &mut KvCache, seq: usize) -> Result<(), ControlError> {
        let window = cache.take_mass_window(seq).map_err(cache_err)?;
        let firsts: Vec<Vec<usize>> = (0..cache.config().num_kv_heads).map(|h| cache.positioned_pages(seq, h).map(|ps| ps.into_iter().map(|p| p.2).collect())).collect::<Result<_, _>>().map_err(cache_err)?;
        self.roll(&firsts, &window).map_err(ControlError::Importance)
    }
}

/// A [`PositionMap`] read from a `KvCache`.
pub trait OfCache: Sized {
    /// The positions `cache` records for `seq` (no earlier `sync` needed).
    fn of_cache(cache: &KvCache, seq: usize) -> Result<Self, ControlError>;
}

impl OfCache for PositionMap {
    fn of_cache(cache: &KvCache, seq: usize) -> Result<PositionMap, ControlError> {
        let len = cache.seq_len(seq).map_err(cache_err)?;
        let heads: Vec<Vec<(TierId, usize, usize)>> = (0..cache.config().num_kv_heads)
            .map(|h| cache.positioned_pages(seq, h).map(|ps| ps.into_iter().map(|(page, tokens, first)| (page.tier, tokens, first)).collect()))
            .collect::<Result<_, _>>()
            .map_err(cache_err)?;
        Ok(PositionMap::from_positioned(seq, cache.spec().page.tokens, len, &heads))
    }
}

/// An [`RdrPipeline`] boundary with the window taken from a `KvCache`.
pub trait InvokeCache {
    /// Takes the sequence's importance window from the GPU and runs the boundary.
    fn invoke_cache(&mut self, cache: &mut KvCache) -> Result<Boundary, ControlError>;
}

impl InvokeCache for RdrPipeline {
    fn invoke_cache(&mut self, cache: &mut KvCache) -> Result<Boundary, ControlError> {
        let t0 = Instant::now();
        let rows = cache.take_mass_window_rows(&[self.seq()]).map_err(cache_err)?;
        let window_us = t0.elapsed().as_secs_f64() * 1e6;
        let row = rows.into_iter().next().unwrap_or_default();
        let mut b = self.invoke_deferred(cache, Box::new(move || row.shares()))?;
        b.window_us = window_us;
        b.critical_us += window_us;
        Ok(b)
    }
}

/// The boundaries of several sequences' pipelines that fall on the same step (a batch
/// decoding together), with the device work shared: every window comes down in one download
/// ([`KvCache::take_mass_window_rows`]; the planner threads turn them into shares), and every
/// plan that is due lands in one `kvforge_control::runtime::apply_grown_many` (one transcode launch per tier
/// pair for the whole batch, one synchronisation). Then each pipeline hands its snapshot to its
/// planner. The download's and the apply's times are split evenly over the boundaries'
/// `window_us` and `apply_us`.
///
/// A plan whose view went stale fails its own sequence's boundary (`Stale`, the others go on);
/// an error of the cache fails them all (`KvCache::retier_many` says what a device fault
/// leaves).
pub fn invoke_all(pipes: &mut [RdrPipeline], cache: &mut KvCache) -> Result<Vec<Boundary>, ControlError> {
    let t0 = Instant::now();
    let seqs: Vec<usize> = pipes.iter().map(RdrPipeline::seq).collect();
    let windows = cache.take_mass_window_rows(&seqs).map_err(cache_err)?;
    let window_us = t0.elapsed().as_secs_f64() * 1e6 / pipes.len().max(1) as f64;
    let windows: Vec<DeferredWindow> = windows.into_iter().map(|w| Box::new(move || w.shares()) as DeferredWindow).collect();
    let mut out = invoke_all_deferred(pipes, cache, windows)?;
    for b in &mut out {
        b.window_us = window_us;
        b.critical_us += window_us;
    }
    Ok(out)
}
