//! Why a codec's f64 reference cannot encode inputs or decode a segment.

/// Why inputs cannot be encoded or a segment cannot be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RefError {
    /// Zero tokens: there is nothing to code and no page to write.
    #[error("no tokens: encoding needs at least one token")]
    Empty,
    /// A slice whose length does not match the geometry.
    #[error("`{what}` has {found} elements, expected {expected} ({why})")]
    Shape { what: &'static str, found: usize, expected: usize, why: String },
    /// A geometry the scheme cannot code (e.g. a token count that is not whole blocks).
    #[error("{0}")]
    Geometry(String),
    /// NaN or infinity: min/max and norms of such values are meaningless.
    #[error("`{what}` element {index} is {value}, only finite values can be coded")]
    NonFinite { what: &'static str, index: usize, value: f32 },
}
