//! Spec errors that point at the file, line and column, name the field and say what would be
//! valid.

use std::fmt;
use std::ops::Range;

#[derive(Debug, Clone, PartialEq)]
pub enum SpecErrorKind {
    /// TOML syntax, unknown keys, wrong types (reported by the TOML reader).
    Syntax,
    /// A value that parses but is not allowed.
    Invalid,
    /// A codebook file that is missing, malformed, the wrong shape or not unit norm.
    Codebook,
    Io,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SpecError {
    pub kind: SpecErrorKind,
    pub file: String,
    /// 1-based; 0 when the error has no location (an unreadable file).
    pub line: usize,
    pub column: usize,
    /// Dotted path of the field, e.g. `tier[1].key.group`.
    pub field: String,
    pub message: String,
    /// The offending source line, for display.
    pub snippet: String,
}

impl std::error::Error for SpecError {}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line > 0 {
            write!(f, "{}:{}:{}: ", self.file, self.line, self.column)?;
        } else {
            write!(f, "{}: ", self.file)?;
        }
        if !self.field.is_empty() {
            write!(f, "`{}`: ", self.field)?;
        }
        write!(f, "{}", self.message)?;
        if !self.snippet.is_empty() {
            write!(f, "\n    | {}\n    | {}^", self.snippet, " ".repeat(self.column.saturating_sub(1)))?;
        }
        Ok(())
    }
}

/// Maps byte spans of one source text to line/column.
pub(crate) struct Locator<'a> {
    pub file: &'a str,
    pub src: &'a str,
}

impl Locator<'_> {
    pub fn error(&self, kind: SpecErrorKind, span: Option<Range<usize>>, field: &str, message: impl Into<String>) -> SpecError {
        let (line, column, snippet) = match span {
            Some(span) => {
                let start = span.start.min(self.src.len());
                let before = &self.src[..start];
                let line = before.matches('\n').count() + 1;
                let line_start = before.rfind('\n').map_or(0, |i| i + 1);
                let column = self.src[line_start..start].chars().count() + 1;
                let snippet = self.src[line_start..].lines().next().unwrap_or("").to_string();
                (line, column, snippet)
            }
            None => (0, 0, String::new()),
        };
        SpecError { kind, file: self.file.to_string(), line, column, field: field.to_string(), message: message.into(), snippet }
    }
}
