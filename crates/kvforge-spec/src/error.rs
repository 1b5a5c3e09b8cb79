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
                let mut start = span.start.min(self.src.len());
                while !self.src.is_char_boundary(start) {
                    start -= 1;
                }
                let before = &self.src[..start];
                let line = before.matches('\n').count() + 1;
                let line_start = before.rfind('\n').map_or(0, |i| i + 1);
                let column = self.src[line_start..start].chars().count() + 1;
                let snippet = self.src[line_start..].lines().next().unwrap_or("").to_string();
                (line, column, snippet)
            }
            None => (0, 0, String::new()),
        };
        // Bounded: a pathological input (a line of 100 000 nested arrays) must not make a
        // message of its size.
        let snippet = clip_line(&snippet, column);
        SpecError { kind, file: self.file.to_string(), line, column, field: clip(field, MAX_FIELD_CHARS), message: clip(&message.into(), MAX_MESSAGE_CHARS), snippet }
    }
}

impl Locator<'_> {
    /// Turns an error of the TOML reader into a [`SpecError`] whose field is the dotted path of
    /// the offending key (found from the error's span) and whose message uses TOML's words.
    pub fn toml(&self, e: &toml::de::Error) -> SpecError {
        let msg = e.message().trim().to_string();
        let span = e.span();
        let (at, section) = span.clone().map(|s| field_at(self.src, s)).unwrap_or_default();
        let quoted = msg.split('`').nth(1).unwrap_or("");
        let (field, message) = if msg.starts_with("unknown field") {
            // The span is the key's own: `at` already ends in the unknown name.
            let field = if at.rsplit('.').next() == Some(quoted) || at == quoted { at } else { join(&at, quoted) };
            (field, msg.replacen("expected", "valid:", 1).replace("valid: one of", "valid:"))
        } else if msg.starts_with("missing field") {
            let field = join(&at, quoted);
            let what = required_hint(quoted);
            (field, format!("missing required field `{quoted}`{what}"))
        } else if msg == "duplicate key" {
            let key = span.clone().and_then(|s| self.src.get(s)).unwrap_or("").trim().to_string();
            let field = match span.clone() {
                // A key of a `[section]` (possibly dotted, `key.scheme`): the section, then the
                // key as written on its line.
                Some(s) if at.is_empty() => {
                    let line_start = self.src.get(..s.start).and_then(|b| b.rfind('\n')).map_or(0, |i| i + 1);
                    let written = self.src.get(line_start..s.end).unwrap_or("").trim();
                    join(&section, written)
                }
                // A table header (`at` is its path) or a key of an inline table (`at` is the table).
                _ if at == key || at.ends_with(&format!(".{key}")) => at,
                _ => join(&at, &key),
            };
            (field, format!("duplicate key `{key}`: a key may appear once per table"))
        } else if msg.contains("expected struct RawScheme") {
            // `key = "fp16"`: a scheme is a table.
            let found = msg.split(", expected").next().unwrap_or(&msg).replace("invalid type: ", "");
            (at, format!("a scheme is a table like {{ scheme = \"fp16\" }}, not {}", toml_words(&found)))
        } else if let Some(i) = msg.find(" as i128") {
            // An integer beyond 64 bits: serde's words name the Rust type it tried.
            let n = msg[..i].rsplit("integer ").next().unwrap_or("").trim_matches('`');
            (at, format!("integer {n} is out of range"))
        } else {
            (at, toml_words(&msg))
        };
        self.error(SpecErrorKind::Syntax, span, &field, message)
    }
}

const MAX_FIELD_CHARS: usize = 120;
const MAX_MESSAGE_CHARS: usize = 600;
const SNIPPET_CHARS: usize = 200;

/// `s` cut to `max` characters, with `…` where it was cut.
fn clip(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// The source line for display, cut [`SNIPPET_CHARS`] past `column` (1-based, which stays the
/// source column); none where the column itself is further in than that.
fn clip_line(line: &str, column: usize) -> String {
    if column > SNIPPET_CHARS {
        return String::new();
    }
    clip(line, column + SNIPPET_CHARS)
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}.{name}")
    }
}

/// What a required field holds, for "missing field" messages.
fn required_hint(name: &str) -> &'static str {
    match name {
        "spec" => " (a [spec] table with the spec's `name`)",
        "geometry" => " (a [geometry] table with `head_dims` and `gqa`)",
        "tier" => " (at least one [[tier]] with `name`, `key` and `value`)",
        "name" => " (a name of letters, digits and `_`)",
        "head_dims" => " (a list of head dims; valid: 64, 128, 256)",
        "gqa" => " (a list of query heads per kv head; valid: 1, 2, 3, 4, 6, 8)",
        "key" | "value" => " (a scheme table, e.g. { scheme = \"fp16\" })",
        "scheme" => " (one of fp16, bf16, int, spherical, drop)",
        _ => "",
    }
}

/// Serde's Rust words to TOML's.
pub(crate) fn toml_words(msg: &str) -> String {
    msg.replace("expected i64", "expected an integer")
        .replace("expected a sequence", "expected an array")
        .replace("invalid type: map", "invalid type: table")
        .replace("invalid type: sequence", "invalid type: array")
        .replace("expected struct RawShape", "expected a table like { warps = 8, ctas_per_sm = 2 }")
        .replace("expected struct RawMeta", "expected a table")
        .replace("expected struct RawGeometry", "expected a table")
        .replace("expected struct RawPage", "expected a table")
        .replace("expected struct RawKernels", "expected a table")
        .replace("expected struct RawTier", "expected a table")
}

/// Dotted path (`tier[1].key.group`) of the deepest key or value whose span is `span`, else of
/// the deepest value that contains its start; empty at the top level. Second: the path of the
/// `[section]` or `[[section]]` whose header last precedes `span`.
fn field_at(src: &str, span: Range<usize>) -> (String, String) {
    use toml::de::{DeTable, DeValue};
    use toml::Spanned;

    struct Best {
        depth: usize,
        exact: bool,
        path: String,
        /// Start and path of the last header before `span`.
        section: (usize, usize, String),
    }
    fn visit(v: &Spanned<DeValue<'_>>, path: String, depth: usize, span: &Range<usize>, best: &mut Best, src: &str) {
        let s = v.span();
        let header = matches!(v.get_ref(), DeValue::Table(_)) && src.as_bytes().get(s.start) == Some(&b'[');
        if header && s.end <= span.start && (s.start, depth) >= (best.section.0, best.section.1) {
            best.section = (s.start, depth, path.clone());
        }
        let exact = s == *span;
        let contains = !span.is_empty() && s.start <= span.start && span.start < s.end;
        if (exact && (!best.exact || depth >= best.depth)) || (contains && !best.exact && depth >= best.depth) {
            best.depth = depth;
            best.exact = exact;
            best.path = path.clone();
        }
        match v.get_ref() {
            DeValue::Table(t) => table(t, &path, depth, span, best, src),
            DeValue::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    visit(x, format!("{path}[{i}]"), depth + 1, span, best, src);
                }
            }
            _ => {}
        }
    }
    fn table(t: &DeTable<'_>, path: &str, depth: usize, span: &Range<usize>, best: &mut Best, src: &str) {
        for (k, v) in t.iter() {
            let p = join(path, k.get_ref());
            if k.span() == *span && (!best.exact || depth + 1 >= best.depth) {
                best.depth = depth + 1;
                best.exact = true;
                best.path = p.clone();
            }
            visit(v, p, depth + 1, span, best, src);
        }
    }
    let (root, _) = DeTable::parse_recoverable(src);
    let mut best = Best { depth: 0, exact: false, path: String::new(), section: (0, 0, String::new()) };
    table(root.get_ref(), "", 0, &span, &mut best, src);
    (best.path, best.section.2)
}
