//! Source positions: the leaf vocabulary the parser, the IR's span table and diagnostics share.
//!
//! Takes nothing; gives [`Span`], a byte range in a `.sched` file. It imports nothing from
//! the crate, so every stage can name a position without depending on the front end.

/// A byte range `[start, end)` in the source text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
pub struct Span {
    /// First byte.
    pub start: u32,
    /// One past the last byte.
    pub end: u32,
}

impl Span {
    /// A span from byte offsets (saturating at `u32::MAX`; files that large are rejected earlier).
    pub fn new(start: usize, end: usize) -> Span {
        Span {
            start: start.min(u32::MAX as usize) as u32,
            end: end.min(u32::MAX as usize) as u32,
        }
    }

    /// The smallest span covering both.
    pub fn join(self, other: Span) -> Span {
        Span {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }

    /// Length in bytes.
    pub fn len(self) -> usize {
        (self.end - self.start) as usize
    }

    /// True for an empty span.
    pub fn is_empty(self) -> bool {
        self.end == self.start
    }
}
