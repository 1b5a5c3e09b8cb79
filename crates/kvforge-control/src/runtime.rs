//! Applying plans to a cache: `KvCache` on the GPU, or [`SimCache`], its CPU twin.
//!
//! [`apply`] validates the plan ([`check_plan`](crate::check_plan)), checks that the cache still looks like the
//! view, hands all its moves to the cache in one [`PagedCache::retier_pages`] call and verifies
//! the cache afterwards against [`simulate`](crate::simulate). One call per sequence lets `KvCache` re-code with
//! one transcode launch per (from tier, to tier) pair instead of one per page, whose launches
//! dominated the cost of applying a plan. The batch takes the indices of the view (before any move), so
//! `apply` shifts nothing; the safe order (drops free pages first, deepest source tier first)
//! is the cache's business (`kvforge_rt::MoveBatch`).
//!
//! [`PositionMap`] keeps the logical token positions of every page (after a drop a page's
//! index no longer says where it sits in the context) for any [`PagedCache`], and builds
//! [`PageTableView`]s from a cache and an importance signal. `KvCache` records positions
//! itself; kvforge-control-rt's `PositionMap::of_cache` reads them, so a caller that holds no map between
//! invocations (the Python bindings) still gets the right positions.

use kvforge_paging::MoveBatch;
pub use kvforge_paging::{PageMove, PagedCache};
use kvforge_spec::{Spec, TierId, TAIL_TIER};

use crate::budget::TierCosts;
use crate::check::{checked, Violation};
use crate::plan::{Limits, Plan};
use crate::signal::{PageInfo, PageKey, PageTableView};

/// Why a plan was not (fully) applied.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("plan rejected before touching the cache: {0}")]
    Plan(Violation),
    #[error("the view is stale: kv head {head} of sequence {seq} has pages {found:?} in the cache, the view has {expected:?} ((tier, tokens) each)")]
    Stale { seq: usize, head: usize, expected: Vec<(TierId, usize)>, found: Vec<(TierId, usize)> },
    /// The cache refused or failed the plan's `total` moves. `KvCache` and [`SimCache`] check
    /// the whole batch first, so a refusal (bad move, out of pages) changed nothing; what a
    /// device fault part-way leaves is in `KvCache::retier_pages`.
    #[error("the cache failed the plan's {total} decisions: {source}")]
    Cache { total: usize, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("the cache does not match the plan afterwards: {0}")]
    Verify(Violation),
    #[error("position map out of sync: {0}")]
    Positions(String),
    #[error("importance window: {0}")]
    Importance(#[from] crate::window::ImportanceError),
    /// The planner thread of an [`RdrPipeline`](crate::pipeline::RdrPipeline) could not
    /// start, ended or was shut down.
    #[error("RDR planner: {0}")]
    Planner(String),
}

/// What [`apply`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ApplyReport {
    pub dropped: usize,
    pub retiered: usize,
    /// Kernel launches the re-codes took (one per (from tier, to tier) pair on `KvCache`).
    pub launches: usize,
    /// Bytes of the sequence before and after, in the view's cost model.
    pub bytes_before: f64,
    pub bytes_after: f64,
}

impl ApplyReport {
    /// The report of applying `plan` to `view` (leaving `after`), less its launches.
    fn of(view: &PageTableView, plan: &Plan, after: &PageTableView) -> ApplyReport {
        let dropped = plan.decisions.iter().filter(|d| view.costs.tiers[d.to_tier as usize].drop).count();
        ApplyReport { dropped, retiered: plan.decisions.len() - dropped, launches: 0, bytes_before: view.cost(), bytes_after: after.cost() }
    }
}

fn counts<C: PagedCache>(cache: &C, seq: usize, head: usize) -> Result<(usize, Option<usize>), ControlError> {
    cache.page_counts(seq, head).map_err(|e| ControlError::Cache { total: 0, source: Box::new(e) })
}

fn observed<C: PagedCache>(cache: &C, seq: usize, head: usize) -> Result<Vec<(TierId, usize)>, ControlError> {
    cache.page_tiers(seq, head).map_err(|e| ControlError::Cache { total: 0, source: Box::new(e) })
}

/// Applies `plan` (made by a controller for `view` under `limits`) to sequence `seq`.
pub fn apply<C: PagedCache>(cache: &mut C, seq: usize, view: &PageTableView, plan: &Plan, limits: &Limits) -> Result<ApplyReport, ControlError> {
    let after = checked(view, plan, limits).map_err(ControlError::Plan)?;
    check_fresh(cache, seq, view, false)?;
    let moves = page_moves(plan);
    let launches = cache.retier_pages(seq, &moves).map_err(|e| ControlError::Cache { total: moves.len(), source: Box::new(e) })?;
    finish(cache, seq, &after, false, ApplyReport { launches, ..ApplyReport::of(view, plan, &after) })
}

/// A plan validated against its view ([`check_plan`](crate::check_plan)), with the view as it
/// will be after it: what [`apply_grown`] needs, made where the plan is made (a planner
/// thread), so that the decode thread only re-codes and verifies.
#[derive(Clone, Debug)]
pub struct CheckedPlan {
    view: PageTableView,
    plan: Plan,
    after: PageTableView,
    /// The cache's layout epoch when the view's page table was read, if it keeps one.
    epoch: Option<u64>,
    /// What applying it will report, less the launches, computed once at check time so that
    /// applying does not sum the view's page costs a second time on the decode thread.
    report: ApplyReport,
}

impl CheckedPlan {
    pub fn new(view: PageTableView, plan: Plan, limits: &Limits) -> Result<CheckedPlan, Violation> {
        let after = checked(&view, &plan, limits)?;
        let report = ApplyReport::of(&view, &plan, &after);
        Ok(CheckedPlan { view, plan, after, epoch: None, report })
    }

    /// Records the [`layout_epoch`](PagedCache::layout_epoch) of the page table the view was
    /// made from: [`apply_grown`] then skips its staleness walk while the cache's is the same.
    pub fn read_at(mut self, epoch: Option<u64>) -> CheckedPlan {
        self.epoch = epoch;
        self
    }

    pub fn view(&self) -> &PageTableView {
        &self.view
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The view's pages with the plan applied.
    pub fn after(&self) -> &PageTableView {
        &self.after
    }

    pub fn into_parts(self) -> (PageTableView, Plan) {
        (self.view, self.plan)
    }
}

/// Applies a checked plan to a cache that may have *grown* since its view was taken: tokens
/// appended to every head (the view's tail page filled and new pages behind it), nothing
/// else. The pages a plan names keep their indices under appends (the cache only appends
/// behind them and only plans remove pages), so the plan's moves are the same moves;
/// `append(n) ∘ apply(plan) = apply(plan) ∘ append(n)` page for page. This is what lets a
/// plan made from a snapshot be applied `every` decode steps later ([`crate::pipeline`]).
///
/// Checks the view's full pages against the cache (tier and tokens; the view's tail may
/// have filled), re-codes, and verifies those pages' tiers afterwards.
pub fn apply_grown<C: PagedCache>(cache: &mut C, seq: usize, checked: &CheckedPlan) -> Result<ApplyReport, ControlError> {
    apply_grown_many(cache, &[(seq, checked)])?.pop().expect("one report per plan")
}

/// Whether the cache's pages of one head are the view's (`grown`: or the view's followed by
/// appends).
fn matches(view: &[crate::signal::PageInfo], found: &[(TierId, usize)], page_tokens: usize, grown: bool) -> bool {
    if !grown {
        return found.len() == view.len() && view.iter().zip(found).all(|(p, f)| (p.tier, p.tokens) == *f);
    }
    found.len() >= view.len()
        && view.iter().zip(found).all(|(p, &(tier, tokens))| match (p.tier == TAIL_TIER, tier == TAIL_TIER) {
            (false, _) => (p.tier, p.tokens) == (tier, tokens),
            // The tail grew, or filled into a full page.
            (true, true) => tokens >= p.tokens,
            (true, false) => tokens == page_tokens,
        })
}

/// [`apply_grown`] of several sequences' plans (each sequence once) with one
/// [`PagedCache::retier_many`] call: `KvCache` makes one transcode launch per tier pair for
/// all of them and synchronises once, where one call per sequence synchronised per sequence
/// and the synchronisations dominated an RDR boundary. Per plan: `Stale` when its view no longer matches the cache (that plan is
/// left out, the others apply), else what applying it did. `Err` when the cache failed the
/// batch: a refusal (a bad move, too few free pages) changed nothing; a device fault applied
/// the launches before it (`KvCache::retier_many`).
pub fn apply_grown_many<C: PagedCache>(cache: &mut C, plans: &[(usize, &CheckedPlan)]) -> Result<Vec<Result<ApplyReport, ControlError>>, ControlError> {
    let mut out: Vec<Result<ApplyReport, ControlError>> = plans.iter().map(|&(seq, c)| fresh(cache, seq, c).map(|_| ApplyReport::default())).collect();
    let go: Vec<usize> = (0..plans.len()).filter(|&i| out[i].is_ok()).collect();
    let moves: Vec<Vec<PageMove>> = go.iter().map(|&i| page_moves(&plans[i].1.plan)).collect();
    let batch: Vec<(usize, &[PageMove])> = go.iter().zip(&moves).map(|(&i, m)| (plans[i].0, &m[..])).collect();
    let total = moves.iter().map(Vec::len).sum();
    let launches = cache.retier_many(&batch).map_err(|e| ControlError::Cache { total, source: Box::new(e) })?;
    for (&i, launches) in go.iter().zip(launches) {
        let (seq, c) = plans[i];
        out[i] = finish(cache, seq, &c.after, true, ApplyReport { launches, ..c.report });
    }
    Ok(out)
}

/// The plan's decisions as the cache's page moves.
fn page_moves(plan: &Plan) -> Vec<PageMove> {
    plan.decisions.iter().map(|d| (d.page.head, d.page.index, d.to_tier)).collect()
}

/// Whether a checked plan still applies to the cache, grown since its view: while the cache's
/// layout epoch is the one the view was read at, only appends happened, which a grown plan
/// allows, so the page table need not be walked.
fn fresh<C: PagedCache>(cache: &C, seq: usize, c: &CheckedPlan) -> Result<(), ControlError> {
    let unchanged = c.view.seq == seq && c.epoch.is_some() && c.epoch == cache.layout_epoch(seq);
    if unchanged {
        return Ok(());
    }
    check_fresh(cache, seq, &c.view, true)
}

/// After the moves: the invariant check (debug builds), then the report.
fn finish<C: PagedCache>(cache: &C, seq: usize, after: &PageTableView, grown: bool, report: ApplyReport) -> Result<ApplyReport, ControlError> {
    // The page-table invariant checker runs in debug builds (issue 7): a release build trusts
    // `retier_pages`, which reports every move it could not make, and saves the decode thread
    // a walk of every page per sequence and boundary.
    if cfg!(debug_assertions) {
        verify_after(cache, seq, after, grown)?;
    }
    Ok(report)
}

/// The cache's pages of `seq` are `view`'s (`grown`: followed by appends), else the plan made
/// from the view is stale.
fn check_fresh<C: PagedCache>(cache: &C, seq: usize, view: &PageTableView, grown: bool) -> Result<(), ControlError> {
    let p = view.costs.page_tokens;
    for (h, pages) in view.heads.iter().enumerate() {
        let found = observed(cache, seq, h)?;
        if !matches(pages, &found, p, grown) || view.seq != seq {
            let expected: Vec<(TierId, usize)> = pages.iter().map(|p| (p.tier, p.tokens)).collect();
            return Err(ControlError::Stale { seq, head: h, expected, found });
        }
    }
    Ok(())
}

/// The cache's pages of `seq` after a plan are `after`'s (`grown`: followed by appends).
fn verify_after<C: PagedCache>(cache: &C, seq: usize, after: &PageTableView, grown: bool) -> Result<(), ControlError> {
    let costs = &after.costs;
    let is_drop = |t: TierId| costs.tiers[t as usize].drop;
    for (h, pages) in after.heads.iter().enumerate() {
        let found = observed(cache, seq, h)?;
        if let Some(&(t, _)) = found.iter().find(|(t, _)| !costs.contains(*t) || is_drop(*t)) {
            return Err(ControlError::Verify(Violation::UnknownTier { page: crate::signal::PageId { head: h, index: 0 }, tier: t }));
        }
        // Grown: the view's pages are a prefix; its tail may have filled since.
        let n = if grown { pages.len().min(found.len()) } else { found.len() };
        let same = (grown || found.len() == pages.len()) && pages.iter().zip(&found[..n]).all(|(p, f)| p.tier == f.0 || (grown && p.tier == TAIL_TIER));
        if !same {
            let expected: Vec<TierId> = pages.iter().map(|p| p.tier).collect();
            return Err(ControlError::Verify(Violation::Mismatch { head: h, expected, found: found.iter().map(|p| p.0).collect() }));
        }
    }
    Ok(())
}

/// The importance signal of one page, as the runtime knows it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Signal {
    pub mass: f64,
    pub token_mass: Option<Vec<f64>>,
    pub pinned: bool,
}

/// Logical token positions of one sequence's pages.
///
/// The cache appends full pages at the end of every head and removes dropped ones; it never
/// reorders. So the first token of every live full page is known if we count the full pages
/// ever created (`filled`) and forget the dropped ones ([`PositionMap::forget`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PositionMap {
    pub seq: usize,
    /// First token of every live full page, per kv head.
    full_first: Vec<Vec<usize>>,
    /// Full pages ever created, per kv head.
    filled: Vec<usize>,
    /// Tokens in the tail page, per kv head.
    tail: Vec<usize>,
}

impl PositionMap {
    pub fn new(seq: usize, heads: usize) -> PositionMap {
        PositionMap { seq, full_first: vec![Vec::new(); heads], filled: vec![0; heads], tail: vec![0; heads] }
    }

    /// The positions of a cache that records them (`KvCache::positioned_pages`, which
    /// kvforge-control-rt's `of_cache` reads): per kv head, `(tier, valid tokens, first token)`
    /// of every page in token order, tail page last, and `len`, the sequence's logical length.
    pub fn from_positioned(seq: usize, page_tokens: usize, len: usize, heads: &[Vec<(TierId, usize, usize)>]) -> PositionMap {
        let mut m = PositionMap::new(seq, heads.len());
        for (h, pages) in heads.iter().enumerate() {
            m.tail[h] = pages.iter().find(|x| x.0 == TAIL_TIER).map_or(0, |x| x.1);
            m.full_first[h] = pages.iter().filter(|x| x.0 != TAIL_TIER).map(|x| x.2).collect();
            m.filled[h] = (len - m.tail[h]) / page_tokens;
        }
        m
    }

    /// Learns the pages appended since the last call.
    pub fn sync<C: PagedCache>(&mut self, cache: &C) -> Result<(), ControlError> {
        let p = cache.spec().page.tokens;
        for h in 0..self.full_first.len() {
            self.sync_head(h, counts(cache, self.seq, h)?, p)?;
        }
        Ok(())
    }

    /// First token of every page of every kv head, in page-table order (call
    /// [`sync`](Self::sync) first): what a window kept by page index needs to name its pages.
    pub fn first_tokens<C: PagedCache>(&self, cache: &C) -> Result<Vec<Vec<usize>>, ControlError> {
        let p = cache.spec().page.tokens;
        (0..self.full_first.len()).map(|h| self.head_first_tokens(h, counts(cache, self.seq, h)?, p)).collect()
    }

    /// `(full, tail)`: the head's full pages and tail tokens ([`PagedCache::page_counts`]).
    fn sync_head(&mut self, h: usize, (full, tail): (usize, Option<usize>), p: usize) -> Result<(), ControlError> {
        let known = self.full_first[h].len();
        if full < known {
            return Err(ControlError::Positions(format!("kv head {h} has {full} full pages, {known} were known: a page was dropped behind the map's back (call forget)")));
        }
        for _ in known..full {
            self.full_first[h].push(self.filled[h] * p);
            self.filled[h] += 1;
        }
        self.tail[h] = tail.unwrap_or(0);
        Ok(())
    }

    fn head_first_tokens(&self, h: usize, (full, tail): (usize, Option<usize>), p: usize) -> Result<Vec<usize>, ControlError> {
        let firsts = &self.full_first[h];
        if full != firsts.len() {
            return Err(ControlError::Positions(format!("kv head {h} has {full} full pages, {} are known; call sync", firsts.len())));
        }
        let mut f = Vec::with_capacity(firsts.len() + 1);
        f.extend_from_slice(firsts);
        if tail.is_some() {
            f.push(self.filled[h] * p);
        }
        Ok(f)
    }

    /// Logical length of the sequence (dropped positions included).
    pub fn context_tokens(&self, page_tokens: usize) -> usize {
        self.filled.first().map_or(0, |&f| f * page_tokens + self.tail[0])
    }

    /// A view of the sequence (call [`sync`](Self::sync) first). `signal` is asked once per
    /// page with the page's stable key and token count; masses are normalised per sequence.
    pub fn view<C: PagedCache>(&self, cache: &C, costs: TierCosts, mut signal: impl FnMut(PageKey, usize) -> Signal) -> Result<PageTableView, ControlError> {
        let p = costs.page_tokens;
        let heads = (0..self.full_first.len()).map(|h| self.head_view(cache, h, p, &mut signal)).collect::<Result<Vec<_>, _>>()?;
        Ok(self.finish_view(heads, costs))
    }

    /// [`view`](Self::view) with the kv heads read on the rayon pool (the same view: each
    /// head's pages are built as `view` builds them, then normalised over the sequence in
    /// order). For a signal that reads per-token weights this is what RDKV's allocation after
    /// a long prefill waits on: at 32K tokens × 8 kv heads, summing 2 MB of token weights
    /// on one thread cost as much as the decision.
    pub fn view_par<C: PagedCache + Sync>(&self, cache: &C, costs: TierCosts, signal: impl Fn(PageKey, usize) -> Signal + Sync) -> Result<PageTableView, ControlError> {
        self.view_par_from(cache, costs, pool_pages(), signal)
    }

    /// [`view_par`](Self::view_par) with the heads on the pool from `parallel_pages` full
    /// pages on (its default is [`pool_pages`]), for measuring a host both ways.
    pub fn view_par_from<C: PagedCache + Sync>(&self, cache: &C, costs: TierCosts, parallel_pages: usize, signal: impl Fn(PageKey, usize) -> Signal + Sync) -> Result<PageTableView, ControlError> {
        use rayon::prelude::*;
        let pages: usize = self.full_first.iter().map(Vec::len).sum();
        if rayon::current_num_threads() <= 1 || pages < parallel_pages {
            // One CPU: the pool's worker would only take turns with this thread (and spin).
            // A small view: waking the pool costs more than the pages (below).
            return self.view(cache, costs, signal);
        }
        let p = costs.page_tokens;
        let heads = (0..self.full_first.len()).into_par_iter().map(|h| self.head_view(cache, h, p, &mut &signal)).collect::<Result<Vec<_>, _>>()?;
        Ok(self.finish_view(heads, costs))
    }

    /// The pages of kv head `h` with their signals, unnormalised.
    fn head_view<C: PagedCache>(&self, cache: &C, h: usize, p: usize, signal: &mut impl FnMut(PageKey, usize) -> Signal) -> Result<Vec<PageInfo>, ControlError> {
        let pages = observed(cache, self.seq, h)?;
        let mut out = Vec::with_capacity(pages.len());
        let mut full = self.full_first[h].iter();
        for (tier, tokens) in pages {
            let first_token = if tier == TAIL_TIER { self.filled[h] * p } else { *full.next().ok_or_else(|| ControlError::Positions(format!("kv head {h}: more full pages than known; call sync")))? };
            let s = signal(PageKey { head: h, first_token }, tokens);
            out.push(PageInfo { tier, tokens, first_token, last_token: first_token + tokens.max(1) - 1, mass: s.mass, token_mass: s.token_mass, pinned: s.pinned });
        }
        Ok(out)
    }

    fn finish_view(&self, heads: Vec<Vec<PageInfo>>, costs: TierCosts) -> PageTableView {
        let mut v = PageTableView { seq: self.seq, context_tokens: self.context_tokens(costs.page_tokens), heads, costs };
        v.normalise();
        v
    }

    /// Forgets the pages a plan drops (after it was applied).
    pub fn forget(&mut self, view: &PageTableView, plan: &Plan) {
        for h in 0..self.full_first.len() {
            let gone: Vec<usize> = plan.decisions.iter().filter(|d| d.page.head == h && view.costs.tiers[d.to_tier as usize].drop).map(|d| view.heads[h][d.page.index].first_token).collect();
            self.full_first[h].retain(|f| !gone.contains(f));
        }
    }

    /// [`apply_grown`] followed by [`forget`](Self::forget) (call [`sync`](Self::sync)
    /// first: the pages appended since the view are learnt before the drops are forgotten).
    pub fn apply_grown<C: PagedCache>(&mut self, cache: &mut C, checked: &CheckedPlan) -> Result<ApplyReport, ControlError> {
        let r = apply_grown(cache, self.seq, checked)?;
        self.forget(checked.view(), checked.plan());
        Ok(r)
    }

    /// [`apply`] followed by [`forget`](Self::forget).
    pub fn apply<C: PagedCache>(&mut self, cache: &mut C, view: &PageTableView, plan: &Plan, limits: &Limits) -> Result<ApplyReport, ControlError> {
        let r = apply(cache, self.seq, view, plan, limits)?;
        self.forget(view, plan);
        Ok(r)
    }
}

/// With a pool of two or three threads, views (and RDKV's per-head solves) of fewer full pages
/// than this stay on the calling thread: on a pool this small the workers' wake-up, not the
/// work, is what a hand-off waits on, and one thread was faster at 32K tokens × 8 kv heads
/// (4096 pages; measurements in docs/perf/NOTES.md).
pub const POOL_PAGES_NARROW: usize = 16384;

/// With a pool of four threads or more the heads go to it from this many pages on: with that
/// many workers the pool was faster than one thread from a few thousand pages
/// (`controller_cost rdkv --parallel-pages`; measurements in docs/perf/NOTES.md).
pub const POOL_PAGES_WIDE: usize = 1024;

/// The page count from which [`PositionMap::view_par`] and RDKV's decision
/// ([`RdkvController::parallel_pages`](crate::RdkvController::parallel_pages)) use the rayon
/// pool on this host.
pub fn pool_pages() -> usize {
    if rayon::current_num_threads() >= 4 {
        POOL_PAGES_WIDE
    } else {
        POOL_PAGES_NARROW
    }
}

/// Error of [`SimCache`].
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct SimError(pub String);

impl From<kvforge_paging::MoveError> for SimError {
    fn from(e: kvforge_paging::MoveError) -> SimError {
        SimError(e.to_string())
    }
}

/// A CPU model of `KvCache`'s page bookkeeping (no bytes): appends fill a tail page per head
/// and turn full ones into `target` pages; `retier_pages` checks and orders a batch with the
/// very code `KvCache::retier_pages` uses ([`MoveBatch`]), and `retier` is its one-move case.
/// Optional per-tier page capacity models the pool. Tests drive controllers and [`apply`]
/// through it; a GPU test can compare both.
#[derive(Clone, Debug)]
pub struct SimCache {
    spec: Spec,
    head_dim: usize,
    heads: usize,
    target: TierId,
    seqs: Vec<Vec<Vec<(TierId, usize)>>>,
    /// Pages per tier the pool holds (None: unlimited).
    pub capacity: Option<Vec<usize>>,
    /// Every page move, in the order the cache makes it: (seq, head, index, to), `index` in
    /// the table before the call that moved it.
    pub log: Vec<(usize, usize, usize, TierId)>,
    /// Transcode launches `KvCache` would have made, summed over calls.
    pub launches: usize,
    /// Layout epoch per sequence, and the last one handed out.
    epochs: Vec<u64>,
    last_epoch: u64,
}

impl SimCache {
    pub fn new(spec: Spec, head_dim: usize, heads: usize, target: TierId) -> SimCache {
        SimCache { spec, head_dim, heads, target, seqs: Vec::new(), capacity: None, log: Vec::new(), launches: 0, epochs: Vec::new(), last_epoch: 0 }
    }

    pub fn add_sequence(&mut self) -> usize {
        self.seqs.push(vec![Vec::new(); self.heads]);
        let epoch = self.new_epoch();
        self.epochs.push(epoch);
        self.seqs.len() - 1
    }

    fn new_epoch(&mut self) -> u64 {
        self.last_epoch += 1;
        self.last_epoch
    }

    /// Appends `n` tokens to every kv head of `seq`.
    pub fn append(&mut self, seq: usize, n: usize) {
        let p = self.spec.page.tokens;
        for pages in self.seqs[seq].iter_mut() {
            let mut tail = match pages.last() {
                Some(&(TAIL_TIER, len)) => {
                    pages.pop();
                    len
                }
                _ => 0,
            };
            tail += n;
            while tail >= p {
                pages.push((self.target, p));
                tail -= p;
            }
            if tail > 0 {
                pages.push((TAIL_TIER, tail));
            }
        }
    }

    fn used(&self, tier: TierId) -> usize {
        self.seqs.iter().flatten().flatten().filter(|x| x.0 == tier).count()
    }
}

impl PagedCache for SimCache {
    type Error = SimError;
    fn spec(&self) -> &Spec {
        &self.spec
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn num_kv_heads(&self) -> usize {
        self.heads
    }
    fn page_tiers(&self, seq: usize, head: usize) -> Result<Vec<(TierId, usize)>, SimError> {
        self.seqs.get(seq).and_then(|s| s.get(head)).cloned().ok_or_else(|| SimError(format!("no sequence {seq} head {head}")))
    }
    fn layout_epoch(&self, seq: usize) -> Option<u64> {
        self.epochs.get(seq).copied()
    }
    fn retier(&mut self, seq: usize, head: usize, index: usize, to: TierId) -> Result<(), SimError> {
        self.retier_pages(seq, &[(head, index, to)]).map(|_| ())
    }
    fn retier_pages(&mut self, seq: usize, moves: &[PageMove]) -> Result<usize, SimError> {
        Ok(self.retier_many(&[(seq, moves)])?[0])
    }
    fn retier_many(&mut self, batch: &[(usize, &[PageMove])]) -> Result<Vec<usize>, SimError> {
        let p = self.spec.page.tokens;
        if let Some(&(seq, _)) = batch.iter().find(|b| b.0 >= self.seqs.len()) {
            return Err(SimError(format!("sequence {seq} does not exist")));
        }
        let moves = MoveBatch::seq_moves(batch)?;
        let seqs = &self.seqs;
        let tier_of = |seq: usize, head: usize, index: usize| {
            let full = seqs[seq].get(head).and_then(|h| h.get(index)).filter(|x| x.0 != TAIL_TIER && x.1 == p);
            full.map(|x| x.0).ok_or_else(|| SimError(format!("bad input: no full page {index} in sequence {seq} head {head}")))
        };
        let free: Vec<usize> = match &self.capacity {
            Some(cap) => (0..cap.len()).map(|t| cap[t].saturating_sub(self.used(t as TierId))).collect(),
            None => vec![usize::MAX; self.spec.tiers.len()],
        };
        // Worded as the runtime's out-of-pages error.
        let out = |t: TierId| {
            let (tier, capacity, page_bytes) = (&self.spec.tiers[t as usize].name, self.capacity.as_ref().map_or(usize::MAX, |c| c[t as usize]), self.spec.segment(t, self.head_dim).page_bytes);
            SimError(format!("out of pages for tier `{tier}`: {capacity} pages of {page_bytes} B are all in use; the cache is unchanged"))
        };
        let plan = MoveBatch::plan(&self.spec, &moves, tier_of, &free, out)?;
        let order = plan.drops.iter().chain(plan.launches.iter().flat_map(|l| &l.2));
        self.log.extend(order.map(|&m| {
            let (s, (h, i, to)) = moves[m];
            (s, h, i, to)
        }));
        self.launches += plan.launches.len();
        for &(s, _) in batch {
            self.epochs[s] = self.new_epoch();
        }
        for &(_, to, ref group) in &plan.launches {
            for &m in group {
                let (s, (h, i, _)) = moves[m];
                self.seqs[s][h][i].0 = to;
            }
        }
        // Dropped pages leave last, so every index above is the one before the call.
        let mut gone: Vec<(usize, usize, usize)> = plan.drops.iter().map(|&m| (moves[m].0, moves[m].1 .0, moves[m].1 .1)).collect();
        gone.sort_unstable_by(|a, b| b.cmp(a));
        for (s, h, i) in gone {
            self.seqs[s][h].remove(i);
        }
        Ok(plan.launches_of(&moves, &batch.iter().map(|b| b.0).collect::<Vec<_>>()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The invariant checker (debug builds run it after every apply) accepts the page table a
    /// plan leaves and names a head whose tiers differ from the plan's.
    #[test]
    fn verify_after_names_a_page_table_that_differs_from_the_plan() {
        let spec = Spec::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/rdkv.toml")).unwrap();
        let p = spec.page.tokens;
        let mut cache = SimCache::new(spec.clone(), 128, 2, 1);
        let seq = cache.add_sequence();
        cache.append(seq, 4 * p + 3);
        let mut pos = PositionMap::new(seq, 2);
        pos.sync(&cache).unwrap();
        let costs = TierCosts::from_spec(&spec, 128, crate::budget::CostModel::Resident);
        let before = pos.view(&cache, costs, |_, _| Signal { mass: 1.0, ..Default::default() }).unwrap();
        verify_after(&cache, seq, &before, false).unwrap();
        // Page 1 of head 1 re-coded behind the view's back: the view no longer describes the cache.
        let to = spec.tier("b4").unwrap().id;
        cache.retier(seq, 1, 1, to).unwrap();
        match verify_after(&cache, seq, &before, false) {
            Err(ControlError::Verify(Violation::Mismatch { head: 1, .. })) => {}
            other => panic!("expected a mismatch on kv head 1, got {other:?}"),
        }
    }
}
