//! The basis a spec stores K and V in. Most codecs code keys and values as they come
//! ([`Basis::Identity`]); a codec may need the rows rotated first ([`Codec::basis`]: the
//! `rotated` codecs' seeded Hadamard rotation). The basis is spec-wide ([`crate::Spec::basis`]):
//! every tier of the spec, the dense tail included, holds rows in it, so a page moves between
//! tiers without leaving the basis. The runtime maps each appended row with
//! [`Basis::to_stored`]; decode maps the query the same way and the output back.
//!
//! [`Codec::basis`]: crate::Codec::basis

use std::fmt;

use crate::codecs::rotated::hadamard;

/// A spec's storage basis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Basis {
    /// Rows stored as they come.
    #[default]
    Identity,
    /// Rows stored as `R x`, `R` the random-sign Hadamard rotation of `seed`
    /// ([`hadamard::rotate`]).
    Hadamard { seed: u32 },
}

impl Basis {
    pub fn is_identity(self) -> bool {
        self == Basis::Identity
    }

    /// Maps `[n][d]` rows to the stored basis in place, in f32: what the runtime does to every
    /// appended key and value row before rounding it to the spec dtype.
    pub fn to_stored(self, d: usize, rows: &mut [f32]) {
        if let Basis::Hadamard { seed } = self {
            hadamard::rotate_rows(seed, d, rows);
        }
    }

    /// [`Basis::to_stored`] in f64 (a query, for a reference that scores in the stored basis).
    pub fn to_stored_f64(self, d: usize, rows: &mut [f64]) {
        if let Basis::Hadamard { seed } = self {
            hadamard::rotate_rows(seed, d, rows);
        }
    }

    /// Maps `[n][d]` rows from the stored basis back, in place, in f64: decoded keys and values
    /// (or an attention output) in the caller's basis.
    pub fn to_natural(self, d: usize, rows: &mut [f64]) {
        if let Basis::Hadamard { seed } = self {
            hadamard::unrotate_rows(seed, d, rows);
        }
    }

    /// [`Basis::to_natural`] in f32.
    pub fn to_natural_f32(self, d: usize, rows: &mut [f32]) {
        if let Basis::Hadamard { seed } = self {
            hadamard::unrotate_rows(seed, d, rows);
        }
    }
}

impl fmt::Display for Basis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Basis::Identity => f.write_str("identity"),
            Basis::Hadamard { seed } => write!(f, "Hadamard seed {seed:#x}"),
        }
    }
}
