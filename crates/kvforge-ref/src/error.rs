//! Typed errors. Segment functions fail with [`RefError`] when their inputs cannot be coded
//! (no tokens, wrong shapes, non-finite values); page functions add [`PageError`] for bytes
//! that cannot be a page of the tier (torn header, wrong tier, impossible length).

pub use kvforge_spec::codecs::RefError;

/// Why bytes are not a valid page of a tier, or a page cannot be written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PageError {
    #[error(transparent)]
    Coding(#[from] RefError),
    /// Magic or checksum mismatch (torn or stale header).
    #[error("corrupt page header: {0}")]
    Header(String),
    #[error("page header names tier {found}, expected tier {expected} (`{name}`)")]
    WrongTier { found: u8, expected: u8, name: String },
    #[error("page header names tier {0}, which the spec does not have")]
    UnknownTier(u8),
    #[error("page holds {length} tokens, more than the {tokens} tokens of a page")]
    TooLong { length: usize, tokens: usize },
    /// Only the tail tier holds partly filled pages; every other tier codes full pages.
    #[error("tier `{tier}` holds only full pages of {tokens} tokens, got {length}")]
    Partial { tier: String, length: usize, tokens: usize },
    #[error("page is {found} bytes, tier `{tier}` at head_dim {d} needs {expected}")]
    Size { tier: String, d: usize, found: usize, expected: usize },
    /// Dropped tokens have no bytes and are never attended, so they have no page.
    #[error("tier `{0}` drops tokens: a dropped token has no page")]
    DropTier(String),
}

/// Why a certified decode step (seed 004, [`crate::certified`]) cannot return an output. There is
/// no third outcome: a step returns an output with a valid certificate (or the exact output), or
/// one of these.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CertError {
    #[error(transparent)]
    Coding(#[from] RefError),
    /// P4: the fp16 original of a block is not resident in tier 2, so neither promotion nor the
    /// exact fallback (rungs 3 and 4) can run; the fast path alone would carry a certificate the
    /// ladder could not back.
    #[error("tier-2 original of block {block} is not resident: no exact fallback is possible (precondition P4)")]
    MissingOriginal { block: usize },
    /// A tier the certified path cannot bound (e.g. fp16 key zeros, whose rounding breaks the
    /// per-channel error bound).
    #[error("tier cannot be certified: {0}")]
    Format(String),
    /// A configuration outside its domain (e.g. τ_cov outside (0, 1]).
    #[error("certified config: {0}")]
    Config(String),
}
