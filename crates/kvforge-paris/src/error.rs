//! Typed errors of the ParisKV reference and planner.

use thiserror::Error;

/// What is wrong with a ParisKV configuration or input.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ParisError {
    /// The head dim is not one the shared Hadamard rotation serves.
    #[error("head_dim {0} is not supported by the SRHT rotation; valid: a power of two from 16 to 256")]
    HeadDim(usize),
    /// The subspace count does not give a subspace dim `m` of 4 to 8 (`2^m` centroid ids must
    /// fit a byte, and the Prop. 4.1 levels need `m ≥ 4`).
    #[error("subspaces {subspaces} must divide head_dim {head_dim} into subspaces of 4 to 8 dims (m = head_dim / subspaces)")]
    Subspaces { head_dim: usize, subspaces: usize },
    /// Collision tiers must be 1 to 15 (a key's score `B · tiers` fits a u16 histogram slot).
    #[error("collision tiers {0} is not supported; valid: 1 to 15")]
    Tiers(u32),
    /// A ratio (ρ or β) outside (0, 1].
    #[error("{name} {value} must be in (0, 1]")]
    Ratio { name: &'static str, value: f64 },
    /// ρ below β: each subspace would vote for fewer keys than the candidate pool holds.
    #[error("rho {rho} must be at least beta {beta} (seed 001 §4.2.2)")]
    RhoBelowBeta { rho: f64, beta: f64 },
    /// A slice whose length does not match the geometry.
    #[error("{what} has {got} values, expected {want}")]
    Length { what: &'static str, got: usize, want: usize },
    /// A non-finite value in a key or query.
    #[error("{what} row {row} holds a non-finite value")]
    NonFinite { what: &'static str, row: usize },
    /// Asked for more keys than the index holds.
    #[error("top-k {k} is more than the {n} indexed keys")]
    TopK { k: usize, n: usize },
    /// The schedule has no point, or its lengths are not increasing.
    #[error("schedule: {0}")]
    Schedule(String),
    /// A compact rerank layout that does not fit the geometry, or compact codes of two
    /// layouts joined (`compact`).
    #[error("compact layout: {0}")]
    Layout(String),
}
