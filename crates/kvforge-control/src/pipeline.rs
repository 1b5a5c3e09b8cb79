//! RDR off the decode critical path: plan on a host thread, apply at the next invocation.
//!
//! An RDR decision is O(pages) on the host (the drop penalty η couples every page, so no
//! page's move can be priced alone), many times a decode step's GPU time at long contexts, so
//! made synchronously even every 64 steps it is a large share of each step (issue 7 asks for
//! < 2%). It does not need to be synchronous:
//! the decision only reads a snapshot (the page table and the importance window), and its
//! moves stay valid while tokens are appended behind them ([`runtime::apply_grown`]). So
//! [`RdrPipeline`] does, at each invocation boundary, on the decode thread:
//!
//! 1. learn the pages appended since the last boundary and key the importance window (taken
//!    from the GPU just before, `KvCache::take_mass_window`) by their first tokens;
//! 2. apply the plan the planner thread made at the *previous* boundary (transcode launches,
//!    page-table updates; it waits only if that plan is not ready, [`Boundary::waited_us`]);
//! 3. copy the page table's `(tier, tokens)` rows and hand them, the window and the position
//!    map to the planner thread, which rolls the EMA, builds the view, decides and checks the
//!    plan ([`CheckedPlan`]) while decoding goes on.
//!
//! **Same plans.** Appending and re-coding commute page for page, so the page table the
//! planner sees at boundary k+1 (plan k applied at k+1, after the appends) is the one the
//! synchronous controller sees at k+1 (plan k applied at k, then the appends); the planner
//! owns the same `RdrController` state (step counter, sticky scores, cooldowns) and rolls the
//! same windows. With [`Headroom::None`] every plan is bit-for-bit the synchronous plan of the
//! same boundary, applied `every` steps later (`tests/pipeline.rs` checks it on random
//! instances). What differs on a GPU is only what the decode kernels observe in between: for
//! `every` more steps they read the pages at their old tiers, so the window's shares differ by
//! the quantisation noise of the moved pages (the score margin of the hysteresis absorbs
//! changes below 10%).
//!
//! **Budget.** A plan lands `every` steps after its snapshot, when `every` more tokens per kv
//! head have arrived in the first ladder tier. Planned against the snapshot's budget, the cache
//! would exceed the budget at the boundary by those arrivals (the synchronous controller
//! exceeds it by them just *before* its boundary). [`Headroom::Arrivals`] (the default) instead
//! plans for the budget in force when the plan lands, less what the arrivals will cost, which
//! are known exactly (each head's tail fills and becomes `tier` pages): right after every
//! boundary the cache is within the budget of that step, as with the synchronous controller.
//! Its plans are the synchronous controller's decision for that budget
//! ([`Headroom::limits`]; also checked against it).
//!
//! Pins: a page pinned after the snapshot is not protected from the plan made before it (its
//! pin takes effect at the next plan).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kvforge_spec::{Spec, TierId, TAIL_TIER};

use crate::budget::{Budget, TierCosts};
use crate::plan::Limits;
use crate::rdr::RdrController;
use crate::runtime::{self, ApplyReport, CheckedPlan, ControlError, PagedCache, PositionMap, SimError};
use crate::signal::PageTableView;
use crate::window::PagedImportance;
use crate::Controller;

/// What a plan made from a snapshot reserves for the tokens that arrive before it lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Headroom {
    /// Nothing: every plan is the synchronous controller's plan for the snapshot.
    None,
    /// The bytes of the `every` tokens per kv head that arrive before the plan lands, new full
    /// pages in `tier` (the cache's target tier, the first ladder tier by default).
    Arrivals { tier: TierId },
}

impl Headroom {
    /// The limits a plan for `view` is made under when it lands `every` decode steps later.
    pub fn limits(&self, view: &PageTableView, limits: &Limits, every: usize) -> Limits {
        let Headroom::Arrivals { tier } = *self else { return *limits };
        let costs = &view.costs;
        let p = costs.page_tokens.max(1);
        let tail_cost = |n: usize| if n > 0 { costs.cost(TAIL_TIER, n) } else { 0.0 };
        let growth: f64 = view
            .heads
            .iter()
            .map(|pages| {
                let tail = pages.last().filter(|x| x.tier == TAIL_TIER).map_or(0, |x| x.tokens);
                let t = tail + every;
                (t / p) as f64 * costs.cost(tier, p) + tail_cost(t % p) - tail_cost(tail)
            })
            .sum();
        let budget = limits.budget.bytes(view.context_tokens + every, view.heads.len()) - growth;
        Limits { budget: Budget::Total(budget), protection: limits.protection }
    }
}

/// The `(tier, tokens)` rows of one sequence's page table, copied at a boundary: what the
/// planner builds its view from (read-only: it re-codes nothing).
#[derive(Clone, Debug)]
pub struct PageSnapshot {
    spec: Arc<Spec>,
    head_dim: usize,
    seq: usize,
    pages: Vec<Vec<(TierId, usize)>>,
    /// The cache's layout epoch when the pages were read.
    epoch: Option<u64>,
}

impl PageSnapshot {
    pub fn of<C: PagedCache>(cache: &C, spec: Arc<Spec>, seq: usize) -> Result<PageSnapshot, ControlError> {
        let pages = (0..cache.num_kv_heads()).map(|h| cache.page_tiers(seq, h)).collect::<Result<_, _>>().map_err(|e| ControlError::Cache { total: 0, source: Box::new(e) })?;
        Ok(PageSnapshot { spec, head_dim: cache.head_dim(), seq, pages, epoch: cache.layout_epoch(seq) })
    }
}

impl PagedCache for PageSnapshot {
    type Error = SimError;
    fn spec(&self) -> &Spec {
        &self.spec
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn num_kv_heads(&self) -> usize {
        self.pages.len()
    }
    fn page_tiers(&self, seq: usize, head: usize) -> Result<Vec<(TierId, usize)>, SimError> {
        if seq != self.seq {
            return Err(SimError(format!("the snapshot holds sequence {}, not {seq}", self.seq)));
        }
        self.pages.get(head).cloned().ok_or_else(|| SimError(format!("the snapshot has no kv head {head}")))
    }
    fn retier(&mut self, _seq: usize, _head: usize, _index: usize, _to: TierId) -> Result<(), SimError> {
        Err(SimError("a page snapshot is read-only".into()))
    }
    fn layout_epoch(&self, seq: usize) -> Option<u64> {
        self.epoch.filter(|_| seq == self.seq)
    }
}

/// An importance window whose shares the planner thread computes: the device rows of
/// `KvCache::take_mass_window_rows` turn into shares with an exp2 per page, work better done
/// off the decode thread (kvforge-control-rt's `invoke_cache` hands them over this way).
pub type DeferredWindow = Box<dyn FnOnce() -> Vec<Vec<Option<f64>>> + Send>;

/// An importance window as the boundary got it: shares, or a [`DeferredWindow`].
enum Window {
    Shares(Vec<Vec<Option<f64>>>),
    Deferred(DeferredWindow),
}

impl Window {
    fn shares(self) -> Vec<Vec<Option<f64>>> {
        match self {
            Window::Shares(w) => w,
            Window::Deferred(f) => f(),
        }
    }
}

/// One boundary's work for the planner thread.
struct Job {
    /// Controller steps counted at the boundary.
    step: u64,
    /// First token of every page the window lists, and the window.
    firsts: Vec<Vec<usize>>,
    window: Window,
    /// Positions and page table after the previous plan was applied.
    pos: PositionMap,
    snapshot: PageSnapshot,
    /// The plan lands at this boundary ([`RdrPipeline::prime`]): no headroom.
    now: bool,
}

/// A plan made by the planner thread.
#[derive(Clone, Debug)]
pub struct Planned {
    pub checked: CheckedPlan,
    /// Controller steps counted at the snapshot the plan was made from.
    pub step: u64,
    /// Wall time of the planner's whole job (roll, view, decide, check), and of the decision.
    pub plan_us: f64,
    pub decide_us: f64,
}

/// What a boundary did on the decode thread.
#[derive(Debug, Default)]
pub struct Boundary {
    /// The plan applied at this boundary (made at the previous one) and what applying it did.
    pub applied: Option<(Planned, ApplyReport)>,
    /// Time spent waiting for that plan (0 when it was ready).
    pub waited_us: f64,
    /// Wall time of the whole boundary on the decode thread, waiting included ([`invoke_all_deferred`]:
    /// the batch's boundary divided evenly over its sequences, as are `window_us` and
    /// `apply_us`).
    pub critical_us: f64,
    /// Of which: taking the importance window from the device (kvforge-control-rt's `invoke_cache`;
    /// 0 when the window came from elsewhere), and applying the plan (page-table checks and
    /// the transcode launches).
    pub window_us: f64,
    pub apply_us: f64,
}

/// What plans are made under: the cost model, the limits and the headroom.
#[derive(Clone, Debug)]
pub struct Planning {
    pub costs: TierCosts,
    pub limits: Limits,
    pub headroom: Headroom,
}

/// The planner thread's side: the controller, the importance EMA and the limits.
struct Planner {
    rdr: RdrController,
    importance: PagedImportance,
    costs: TierCosts,
    limits: Limits,
    headroom: Headroom,
}

impl Planner {
    fn plan(&mut self, job: Job) -> Result<Planned, ControlError> {
        let t0 = Instant::now();
        while self.rdr.steps() < job.step {
            self.rdr.step();
        }
        let window = job.window.shares();
        self.importance.roll(&job.firsts, &window)?;
        let importance = &self.importance;
        let view = job.pos.view(&job.snapshot, self.costs.clone(), |k, _| runtime::Signal { mass: importance.get(k), ..Default::default() })?;
        let limits = if job.now { self.limits } else { self.headroom.limits(&view, &self.limits, self.rdr.every) };
        let t1 = Instant::now();
        let plan = self.rdr.decide(&view, &limits);
        let decide_us = t1.elapsed().as_secs_f64() * 1e6;
        let checked = CheckedPlan::new(view, plan, &limits).map_err(ControlError::Plan)?.read_at(job.snapshot.epoch);
        Ok(Planned { checked, step: job.step, plan_us: t0.elapsed().as_secs_f64() * 1e6, decide_us })
    }
}

/// RDR for one sequence with its decisions made on a planner thread (see the module docs).
///
/// Per decode step decode (tracked when [`tracks`](Self::tracks) says so), then call
/// [`step`](Self::step); when it returns true, call
/// kvforge-control-rt's `invoke_cache` (or [`invoke`](Self::invoke) with a window taken
/// elsewhere). After prefill, [`prime`](Self::prime) makes the first decision synchronously
/// (it moves thousands of pages; nothing to overlap it with).
pub struct RdrPipeline {
    seq: usize,
    spec: Arc<Spec>,
    every: usize,
    /// One tracked decode step in `sample` (`RdrController::sample`).
    sample: usize,
    step: u64,
    pos: PositionMap,
    jobs: Option<Sender<Job>>,
    results: Receiver<Result<Planned, ControlError>>,
    worker: Option<JoinHandle<()>>,
    in_flight: bool,
}

impl RdrPipeline {
    /// Moves `rdr` and `importance` to a new planner thread for sequence `seq` of a cache with
    /// `heads` kv heads. Invocations every `rdr.every` steps.
    pub fn new(rdr: RdrController, importance: PagedImportance, spec: &Spec, seq: usize, heads: usize, planning: Planning) -> Result<RdrPipeline, ControlError> {
        let Planning { costs, limits, headroom } = planning;
        let every = rdr.every.max(1);
        let sample = rdr.sample.max(1);
        let (jobs, inbox) = channel::<Job>();
        let (outbox, results) = channel();
        let mut planner = Planner { rdr, importance, costs, limits, headroom };
        let worker = std::thread::Builder::new()
            .name(format!("rdr-planner-{seq}"))
            .spawn(move || {
                for job in inbox {
                    if outbox.send(planner.plan(job)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| ControlError::Planner(format!("cannot start the planner thread: {e}")))?;
        Ok(RdrPipeline { seq, spec: Arc::new(spec.clone()), every, sample, step: 0, pos: PositionMap::new(seq, heads), jobs: Some(jobs), results, worker: Some(worker), in_flight: false })
    }

    /// Whether the next decode step should record page masses (`KvCache::decode_tracked`
    /// instead of `decode`): one in `sample`, counted back from each boundary's step
    /// ([`RdrController::tracks`]).
    pub fn tracks(&self) -> bool {
        crate::rdr::sampled(self.step, self.every, self.sample)
    }

    /// Counts one decode step; true when this step is an invocation boundary.
    pub fn step(&mut self) -> bool {
        self.step += 1;
        self.step % self.every as u64 == 0
    }

    pub fn every(&self) -> usize {
        self.every
    }

    pub fn sample(&self) -> usize {
        self.sample
    }

    /// Whether a plan is being made (or waits to be applied).
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// First token of every page of the cache as it is now, per kv head (what names the rows
    /// of a window kept outside `KvCache`).
    pub fn first_tokens<C: PagedCache>(&mut self, cache: &C) -> Result<Vec<Vec<usize>>, ControlError> {
        self.pos.sync(cache)?;
        self.pos.first_tokens(cache)
    }

    /// The sequence this pipeline plans for.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// [`invoke`](Self::invoke) with a window whose shares the planner thread computes.
    pub fn invoke_deferred<C: PagedCache>(&mut self, cache: &mut C, window: DeferredWindow) -> Result<Boundary, ControlError> {
        self.boundary(cache, Window::Deferred(window), false)
    }

    /// The boundary (module docs, steps 1–3). `window[h][i]` is page `i` of kv head `h` of the
    /// cache as it is now (before this boundary's plan).
    pub fn invoke<C: PagedCache>(&mut self, cache: &mut C, window: Vec<Vec<Option<f64>>>) -> Result<Boundary, ControlError> {
        self.boundary(cache, Window::Shares(window), false)
    }

    fn boundary<C: PagedCache>(&mut self, cache: &mut C, window: Window, now: bool) -> Result<Boundary, ControlError> {
        Ok(boundaries(std::slice::from_mut(self), cache, vec![window], now)?.pop().expect("one boundary per pipeline"))
    }

    /// Boundary steps 1–2 up to the apply: learns the appended pages, names the window's rows
    /// by their first tokens, and takes the plan in flight (waiting for it if need be).
    fn begin<C: PagedCache>(&mut self, cache: &C) -> Result<(Vec<Vec<usize>>, Option<Planned>, Boundary), ControlError> {
        self.pos.sync(cache)?;
        let firsts = self.pos.first_tokens(cache)?;
        let mut b = Boundary::default();
        let mut planned = None;
        if self.in_flight {
            let t = Instant::now();
            planned = Some(self.receive()?);
            b.waited_us = t.elapsed().as_secs_f64() * 1e6;
        }
        Ok((firsts, planned, b))
    }

    /// Boundary step 3: the page table as it is now, the window and the positions, for the
    /// planner thread ([`send`](Self::send)).
    fn job<C: PagedCache>(&self, cache: &C, firsts: Vec<Vec<usize>>, window: Window, now: bool) -> Result<Job, ControlError> {
        let snapshot = PageSnapshot::of(cache, self.spec.clone(), self.seq)?;
        Ok(Job { step: self.step, firsts, window, pos: self.pos.clone(), snapshot, now })
    }

    fn send(&mut self, job: Job) -> Result<(), ControlError> {
        self.jobs.as_ref().ok_or_else(|| ControlError::Planner("the planner was shut down".into()))?.send(job).map_err(|_| ControlError::Planner("the planner thread ended".into()))?;
        self.in_flight = true;
        Ok(())
    }

    /// Waits for the plan in flight, if any, and applies it now.
    pub fn flush<C: PagedCache>(&mut self, cache: &mut C) -> Result<Option<(Planned, ApplyReport)>, ControlError> {
        if !self.in_flight {
            return Ok(None);
        }
        let planned = self.receive()?;
        self.pos.sync(cache)?;
        let report = self.pos.apply_grown(cache, &planned.checked)?;
        Ok(Some((planned, report)))
    }

    /// A synchronous boundary: [`invoke`](Self::invoke) then [`flush`](Self::flush), so its
    /// plan lands at once (the first decision after prefill), made under the plain limits (no
    /// headroom: nothing arrives before it lands).
    pub fn prime<C: PagedCache>(&mut self, cache: &mut C, window: Vec<Vec<Option<f64>>>) -> Result<Boundary, ControlError> {
        let mut b = self.boundary(cache, Window::Shares(window), true)?;
        let t0 = Instant::now();
        b.applied = self.flush(cache)?;
        b.critical_us += t0.elapsed().as_secs_f64() * 1e6;
        Ok(b)
    }

    fn receive(&mut self) -> Result<Planned, ControlError> {
        self.in_flight = false;
        match self.results.recv() {
            Ok(r) => r,
            Err(_) => Err(ControlError::Planner("the planner thread ended without a plan (it panicked)".into())),
        }
    }
}

/// The boundaries of several sequences' pipelines that fall on the same step (a batch
/// decoding together), `windows[i]` being pipeline i's: every plan that is due lands in one
/// [`runtime::apply_grown_many`] (one transcode launch per tier pair for the whole batch, one
/// synchronisation), then each pipeline hands its snapshot to its planner. kvforge-control-rt's
/// `invoke_all` takes the windows from the GPU in one download and calls this.
///
/// A plan whose view went stale fails its own sequence's boundary (`Stale`, the others go on);
/// an error of the cache fails them all.
pub fn invoke_all_deferred<C: PagedCache>(pipes: &mut [RdrPipeline], cache: &mut C, windows: Vec<DeferredWindow>) -> Result<Vec<Boundary>, ControlError> {
    if windows.len() != pipes.len() {
        return Err(ControlError::Planner(format!("{} windows for {} pipelines", windows.len(), pipes.len())));
    }
    boundaries(pipes, cache, windows.into_iter().map(Window::Deferred).collect(), false)
}

/// Boundary steps 1–3 of pipelines whose boundaries fall on the same step, `windows[i]` being
/// pipeline i's: every due plan lands in one [`runtime::apply_grown_many`], then each pipeline
/// hands its job to its planner. The apply's and the whole's wall times are split evenly over
/// the boundaries (`apply_us`, `critical_us`).
fn boundaries<C: PagedCache>(pipes: &mut [RdrPipeline], cache: &mut C, windows: Vec<Window>, now: bool) -> Result<Vec<Boundary>, ControlError> {
    let n = pipes.len().max(1) as f64;
    let share = |t: Instant| t.elapsed().as_secs_f64() * 1e6 / n;
    let t1 = Instant::now();
    let mut begun = Vec::with_capacity(pipes.len());
    for pipe in pipes.iter_mut() {
        begun.push(pipe.begin(cache)?);
    }
    let t2 = Instant::now();
    let due: Vec<(usize, &CheckedPlan)> = pipes.iter().zip(&begun).filter_map(|(p, (_, planned, _))| planned.as_ref().map(|x| (p.seq, &x.checked))).collect();
    let mut reports = runtime::apply_grown_many(cache, &due)?.into_iter();
    let apply_us = share(t2);
    let (mut out, mut jobs) = (Vec::with_capacity(pipes.len()), Vec::with_capacity(pipes.len()));
    for ((pipe, (firsts, planned, mut b)), window) in pipes.iter_mut().zip(begun).zip(windows) {
        if let Some(planned) = planned {
            let report = reports.next().expect("one report per due plan")?;
            pipe.pos.forget(planned.checked.view(), planned.checked.plan());
            b.applied = Some((planned, report));
            b.apply_us = apply_us;
        }
        jobs.push(pipe.job(cache, firsts, window, now)?);
        out.push(b);
    }
    // The jobs go out last: a planner thread set going takes cores (its decision runs on the
    // rayon pool) from the boundary's remaining work.
    for (pipe, job) in pipes.iter_mut().zip(jobs) {
        pipe.send(job)?;
    }
    let critical = share(t1);
    for b in &mut out {
        b.critical_us = critical;
    }
    Ok(out)
}

impl Drop for RdrPipeline {
    fn drop(&mut self) {
        // Closing the job channel ends the planner's loop.
        self.jobs.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
