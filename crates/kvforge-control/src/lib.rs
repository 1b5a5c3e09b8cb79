//! # kvforge-control: which tier each KV page lives in
//!
//! The runtime stores every (sequence, kv head) as tier-homogeneous pages on a ladder of
//! tiers (a spec). This crate decides, from per-page importance signals and a byte budget,
//! which pages to re-code down the ladder or drop, and applies those decisions safely.
//!
//! * [`signal`]: the CUDA-free input, a [`PageTableView`] (pages per kv head with tier,
//!   tokens, positions, attention mass, pinned flag), and importance smoothing.
//! * [`window`]: the same smoothing over a window of page masses (kept on the GPU by
//!   `KvCache::decode_tracked`): the host works only when the controller runs.
//! * [`budget`]: [`Budget`] and the rate model [`TierCosts`] (bytes per page per tier, from
//!   the spec).
//! * [`distortion`]: the per-tier distortion ε (a documented proxy per coding scheme, or a
//!   calibrated table) and the page weights ([`distortion::Proxy`]).
//! * [`protect`]: sinks, recent window and pinned pages, never dropped nor re-coded below a
//!   floor tier.
//! * [`knapsack`]: the multiple-choice knapsack solver shared by both controllers (Lagrangian
//!   bisection, greedy value-per-byte path, weak-duality gap).
//! * [`rdr`]: seed 000 App. C's rate-distortion retention controller, with hysteresis;
//!   [`pipeline`]: the same decisions made on a planner thread while decoding goes on, each
//!   applied at the next invocation (plan then run).
//! * [`rdkv`]: seed 002's allocation (Alg. 1–2) and its page-level adaptation.
//! * [`check`]: the invariant checker; [`runtime`]: applying plans to a paged cache (a
//!   `KvCache`, or its CPU twin [`runtime::SimCache`]) in a safe order, verified afterwards.
//!
//! The experiments on these controllers (synthetic attention, the error-vs-bytes frontier,
//! the controllers' cost per decode step) live in `kvforge-lab`.
//!
//! This crate is CPU-only: it sees a cache through [`runtime::PagedCache`] (kvforge-paging)
//! and never links CUDA. Driving a `KvCache` on the GPU (taking its importance window,
//! applying plans to it) is `kvforge-control-rt`'s, whose crate docs show one decode loop.

pub mod budget;
pub mod check;
pub mod distortion;
pub mod knapsack;
pub mod pipeline;
mod plan;
pub mod protect;
pub mod rdkv;
pub mod rdr;
pub mod runtime;
pub mod signal;
pub mod window;

pub use budget::{Budget, CostModel, TierCost, TierCosts};
pub use check::{check_plan, simulate, Violation};
pub use distortion::DistortionTable;
pub use pipeline::{Headroom, RdrPipeline};
pub use plan::{Decision, Limits, Plan};
pub use protect::{Guard, Protection};
pub use rdkv::{allocate, allocate_head, Allocation, RdkvController};
pub use rdr::{DropPolicy, RdrController};
pub use signal::{ImportanceTracker, PageId, PageInfo, PageKey, PageTableView};
pub use window::{ImportanceError, PagedImportance};

/// A tier policy: from a snapshot of one sequence's pages and its limits, the pages to move.
///
/// Implementations must return decisions that only move pages down the ladder, at most one
/// per page, never below a protected page's floor, and must meet the budget whenever
/// protection allows it; [`check_plan`] verifies exactly that.
pub trait Controller {
    fn decide(&mut self, view: &PageTableView, limits: &Limits) -> Plan;
}
