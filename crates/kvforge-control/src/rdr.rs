//! RDR, rate-distortion retention (seed 000 App. C), on kvforge pages.
//!
//! Every `every` decode steps the controller solves the multiple-choice knapsack of C.1 over
//! the sequence's pages (all kv heads together, so heads with concentrated attention pay for
//! heads that need breadth): each page takes one tier from its current one down the ladder,
//! `D_i(b) = ω_i · ε(b)` (C.2, [`DistortionTable`]), and the byte budget holds. The solver
//! ([`crate::knapsack`]) is the greedy value-per-byte downgrade path of C.3 located by
//! Lagrangian bisection on λ.
//!
//! Deviations from the seed, and why:
//! * **Monotone tiers.** `KvCache::retier` can only re-code a page down the ladder (the
//!   original is not kept), so the seed's upgrade moves (C.3 "upgrade policy", ρ↑*) do not
//!   exist: every move is irreversible and every move is paid for by the budget. A page thus
//!   changes tier at most `ladder length − 1` times.
//! * **Hysteresis (C.4)** therefore guards against *irreversible* moves made on noise:
//!   - *cooldown*: a page moved at step `s` is frozen until step `s + cooldown`; the solver
//!     first tries without touching frozen pages and only if the budget cannot be met that
//!     way re-solves with them free (those moves are listed in [`Plan::forced`]);
//!   - *score margin*: the importance a page is ranked by is sticky — it is replaced by the
//!     newly observed importance only when they differ by more than `margin` (relative). Two
//!     pages of nearly equal importance keep their order instead of trading places with every
//!     fluctuation, so the one that was judged less important is the one that moves.
//! * **Down-tier before drop** (§2.2 template, C.2's η): [`DropPolicy`]. `Penalty(η)` adds
//!   `η × mean importance` to a drop, so cheap precision cuts are preferred to evictions
//!   unless a page is clearly worthless; `LastResort` makes η large enough that no page is
//!   dropped while any page can still be down-tiered; `Joint` is pure rate-distortion.
//! * **Weights.** C.2's `ω_i · δ_i(b)` is used as is for dropping. For re-coding, when the
//!   runtime supplies per-token masses, the weight is `Σ_t a_t² / ā` ([`Proxy::Concentration`]):
//!   quantisation noise of different tokens adds incoherently, so a head that spreads its
//!   attention thinly tolerates coarse tiers that a head with a few heavy hitters does not.
//!   With the linear weight alone RDR only ties uniform quantisation on the synthetic
//!   end-to-end test (a diffuse head next to a peaked one); with it, RDR has 2–2.5× lower
//!   attention output error at equal bytes. Without token masses (the GPU kernels report one
//!   mass per page) each page counts as one unit, `m_p² / ā`: C.2's linear weight there
//!   evicts the light pages of peaked heads wholesale and loses to uniform int2 at equal
//!   bytes on the frontier (`kvforge frontier`), the page-level square does not.
//! * The drop tier's distortion is `max(ω ε(drop), recode weight × ε(last live tier))`, so
//!   a page's distortion never decreases down the ladder.
//! * Structured per-layer/per-head caps (C.3 prices π) are not implemented: one controller
//!   instance owns one (sequence, layer) budget.
//! * Between invocations new pages arrive in the first ladder tier, so the cache can exceed
//!   the budget by up to `every` tokens' worth of pages until the next decision.

use kvforge_spec::{Spec, TierId};

use crate::distortion::{DistortionTable, Proxy, Weights};
use crate::plan::{assemble, Decision, Limits, Plan, Problem};
use crate::signal::{PageId, PageKey, PageTableView};
use crate::Controller;

/// How dropping is weighed against down-tiering.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DropPolicy {
    /// Drop is the last tier of the ladder like any other.
    Joint,
    /// A drop costs an extra `η × mean page importance` of distortion.
    Penalty(f64),
    /// No drop while a down-tier is possible anywhere (η → ∞).
    LastResort,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct PageState {
    /// Sticky weights (see the module docs).
    score: Weights,
    moved_at: Option<u64>,
    moves: u32,
}

/// Counters for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RdrStats {
    pub invocations: u64,
    pub moves: u64,
    pub drops: u64,
    pub forced: u64,
}

/// Default [`RdrController::sample`]: one tracked decode step in 8.
pub const DEFAULT_SAMPLE: usize = 8;

/// Whether decode step `index` (0-based, counted from the start) is one of the tracked ones
/// when one step in `sample` of every `period` is: counted back from the period's last step
/// (the step of the decision, so the newest masses always reach it), every `sample`-th.
pub fn sampled(index: u64, period: usize, sample: usize) -> bool {
    let (p, s) = (period.max(1) as u64, sample.max(1) as u64);
    (p - 1 - index % p) % s == 0
}

/// The RDR controller of one (sequence, layer).
#[derive(Clone, Debug)]
pub struct RdrController {
    /// Decide every `every` decode steps (seed 000 C.3 N).
    pub every: usize,
    /// Record page masses on one decode step in `sample` ([`tracks`](Self::tracks); the step
    /// of each decision always). The window's maximum then runs over the sampled steps. Why: the tracked
    /// decode costs more than the plain one, and a page's importance is an EMA over windows of `every` steps, so a few
    /// samples per window carry nearly the same ranking (the CPU frontier measures it).
    pub sample: usize,
    /// Decode steps a moved page stays frozen (seed 000 C.4 C, in steps, not invocations).
    pub cooldown: usize,
    /// Relative change of importance needed before a page is re-ranked (0.1 = 10%).
    pub margin: f64,
    pub drop_policy: DropPolicy,
    pub table: DistortionTable,
    /// How attention signals weigh distortion ([`Proxy::Concentration`] by default: per-token
    /// masses when the view has them, page masses as single units otherwise).
    pub proxy: Proxy,
    step: u64,
    /// Per kv head, the state of every page of the last view, by first token (ascending).
    /// Views list pages in token order, so a decision walks both lists together instead of
    /// hashing 4096 keys (at 32K tokens × 8 kv heads that was a sixth of the decision).
    pages: Vec<Vec<(usize, PageState)>>,
    pub stats: RdrStats,
}

impl RdrController {
    /// Defaults: every 64 steps, cooldown 128 steps, 10% margin, drop penalty of one mean
    /// importance, the spec's proxy ε table.
    ///
    /// Why 64: the budget is overrun only when a page fills (new pages arrive in the first
    /// ladder tier, one per kv head every `page_tokens` steps, while the budget grows every
    /// token), so at 64-token pages a decision every 64 steps acts on every new page, as a
    /// decision every 16 did, with a quarter of the invocations; the overrun between
    /// decisions is one page per kv head either way. Each invocation is O(pages) on the host
    /// (issue 7), so the period sets the
    /// controller's cost per step. The cooldown keeps a moved page in place at the next
    /// decision.
    pub fn new(spec: &Spec) -> RdrController {
        RdrController::with_table(DistortionTable::from_spec(spec))
    }

    pub fn with_table(table: DistortionTable) -> RdrController {
        RdrController {
            every: 64,
            sample: DEFAULT_SAMPLE,
            cooldown: 128,
            margin: 0.1,
            drop_policy: DropPolicy::Penalty(1.0),
            table,
            proxy: Proxy::default(),
            step: 0,
            pages: Vec::new(),
            stats: RdrStats::default(),
        }
    }

    /// Whether the next decode step (the one the next [`step`](Self::step) counts) should
    /// record page masses (`KvCache::decode_tracked`): one step in `sample`, counted back
    /// from the step of each decision ([`sampled`]).
    pub fn tracks(&self) -> bool {
        sampled(self.step, self.every, self.sample)
    }

    /// Counts one decode step; true when the controller should run at this step.
    pub fn step(&mut self) -> bool {
        self.step += 1;
        self.step % self.every.max(1) as u64 == 0
    }

    /// Decode steps counted so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Tier changes of a page so far.
    pub fn moves(&self, key: PageKey) -> u32 {
        self.state(key).map_or(0, |s| s.moves)
    }

    fn state(&self, key: PageKey) -> Option<&PageState> {
        let head = self.pages.get(key.head)?;
        head.binary_search_by_key(&key.first_token, |x| x.0).ok().map(|i| &head[i].1)
    }

    /// Sticky weights of the view's pages, in view order: a page keeps the weights it was
    /// last ranked by until one of them changes by more than `margin` (relative). Also
    /// whether each page is in its cooldown, from the same lookup (one hash-map access per
    /// page and invocation: at 4096 pages a second one was measurable).
    ///
    /// The states of pages not in `view` (dropped) are forgotten; the new states are in view
    /// order, so `self.pages[h][i]` is page `(h, i)` of the view until [`Self::keep_sorted`].
    fn scores(&mut self, view: &PageTableView) -> (Vec<Weights>, Vec<bool>) {
        let (margin, step, cooldown) = (self.margin, self.step, self.cooldown as u64);
        let fresh = self.proxy.weights(view);
        let (mut scores, mut frozen) = (Vec::with_capacity(fresh.len()), Vec::with_capacity(fresh.len()));
        let mut fresh = fresh.into_iter();
        let old = std::mem::take(&mut self.pages);
        for (h, pages) in view.heads.iter().enumerate() {
            let prev = old.get(h).map_or(&[][..], Vec::as_slice);
            let mut next = Vec::with_capacity(pages.len());
            let mut j = 0;
            for p in pages {
                // `weights` gives one per page of the view, in view order.
                let Some(w) = fresh.next() else { break };
                // In token order the page is at the cursor; otherwise search.
                while j < prev.len() && prev[j].0 < p.first_token {
                    j += 1;
                }
                let found = if prev.get(j).is_some_and(|x| x.0 == p.first_token) { Some(j) } else { prev.binary_search_by_key(&p.first_token, |x| x.0).ok() };
                let mut st = found.map_or(PageState { score: w, moved_at: None, moves: 0 }, |k| prev[k].1);
                let moved = |a: f64, b: f64| (a - b).abs() > margin * b;
                if moved(w.drop, st.score.drop) || moved(w.recode, st.score.recode) {
                    st.score = w;
                }
                frozen.push(st.moved_at.is_some_and(|at| step < at + cooldown));
                scores.push(st.score);
                next.push((p.first_token, st));
            }
            self.pages.push(next);
        }
        (scores, frozen)
    }

    /// Restores the by-first-token order of the page states (a view not in token order
    /// leaves them in view order) and removes pages a plan drops.
    fn keep_sorted(&mut self, dropped: impl Fn(usize, usize) -> bool) {
        for (h, states) in self.pages.iter_mut().enumerate() {
            let mut i = 0;
            states.retain(|_| {
                i += 1;
                !dropped(h, i - 1)
            });
            if !states.windows(2).all(|w| w[0].0 < w[1].0) {
                states.sort_by_key(|x| x.0);
            }
        }
    }

    /// The drop penalty η in distortion units.
    fn eta(&self, view: &PageTableView, scores: &[Weights]) -> f64 {
        let n = scores.len().max(1) as f64;
        match self.drop_policy {
            DropPolicy::Joint => 0.0,
            DropPolicy::Penalty(x) => x.max(0.0) * scores.iter().map(|w| w.drop).sum::<f64>() / n,
            DropPolicy::LastResort => {
                // Every drop's ρ ≥ η / max page cost must exceed every live move's
                // ρ ≤ max weight · max ε / min cost step.
                let p = view.costs.page_tokens;
                let live: Vec<f64> = view.costs.ladder().filter(|&t| !view.costs.tiers[t as usize].drop).map(|t| view.costs.cost(t, p)).collect();
                let cmax = live.iter().copied().fold(0.0, f64::max);
                let step = live.windows(2).map(|w| w[0] - w[1]).filter(|&d| d > 0.0).fold(f64::INFINITY, f64::min);
                let smax = scores.iter().map(|w| w.recode.max(w.drop)).fold(0.0, f64::max);
                if step.is_finite() {
                    2.0 * smax * cmax / step + 1.0
                } else {
                    1.0
                }
            }
        }
    }
}

impl Controller for RdrController {
    fn decide(&mut self, view: &PageTableView, limits: &Limits) -> Plan {
        assert_eq!(self.table.eps.len(), view.costs.tiers.len(), "RDR: the distortion table and the view's spec have different tier counts");
        self.stats.invocations += 1;
        let budget = limits.budget.bytes(view.context_tokens, view.heads.len());
        let (scores, frozen) = self.scores(view);
        let eta = self.eta(view, &scores);
        let costs = &view.costs;
        // Scores are in view order: page (h, i) is at offset[h] + i.
        let offset = view.offsets();
        let score_of = |id: PageId| scores[offset[id.head] + id.index];
        let frozen_now = |id: PageId| frozen[offset[id.head] + id.index];
        let table = &self.table;
        // Within budget, the knapsack keeps every page where it is (each page's least
        // distortion is its current tier, the most expensive on ties): skip building it. In
        // the steady state that is most invocations (the budget grows with every token, a new
        // first-tier page arrives every `page_tokens` tokens).
        if view.cost() <= budget {
            let dist: f64 = view.iter().map(|(id, p)| table.page(score_of(id), p.tier)).sum();
            let sol = crate::knapsack::Solution { pick: Vec::new(), cost: view.cost(), dist, lambda: 0.0, dual: dist, gap: 0.0, feasible: true, iterations: 0 };
            let plan = assemble(view, Vec::new(), budget, &sol, Vec::new(), |id: PageId, t: TierId| table.page(score_of(id), t));
            self.keep_sorted(|_, _| false);
            return plan;
        }
        let options = |respect_cooldown: bool| {
            Problem::build(view, |id, p, out| {
                let s = score_of(id);
                let frozen = respect_cooldown && frozen_now(id);
                // A plain loop: `extend` over the filtered, taken, mapped iterator was a tenth
                // of a steady decision (no size hint, one capacity check per push).
                for t in limits.protection.allowed_tiers(p, view.context_tokens, costs) {
                    out.push((t, table.page(s, t) + if costs.tiers[t as usize].drop { eta } else { 0.0 }));
                    if frozen {
                        break;
                    }
                }
            })
        };
        let (mut sol, mut decisions) = options(true).solve(view, budget);
        let mut forced = Vec::new();
        if !sol.feasible && self.cooldown > 0 {
            let (s2, d2) = options(false).solve(view, budget);
            forced = d2.iter().filter(|d| frozen_now(d.page)).map(|d| d.page).collect();
            (sol, decisions) = (s2, d2);
        }
        // Commit: moved pages start their cooldown; dropped pages are forgotten.
        let step = self.step;
        for d in &decisions {
            let st = &mut self.pages[d.page.head][d.page.index].1;
            st.moved_at = Some(step);
            st.moves += 1;
            self.stats.moves += 1;
            if costs.tiers[d.to_tier as usize].drop {
                self.stats.drops += 1;
            }
        }
        self.stats.forced += forced.len() as u64;
        let dropped: Vec<PageId> = decisions.iter().filter(|d: &&Decision| costs.tiers[d.to_tier as usize].drop).map(|d| d.page).collect();
        self.keep_sorted(|head, index| dropped.binary_search(&PageId { head, index }).is_ok());
        let table = &self.table;
        assemble(view, decisions, budget, &sol, forced, |id: PageId, t: TierId| table.page(score_of(id), t))
    }
}
