//! Byte offsets in a document to LSP positions and back.
//!
//! The compiler's spans are byte ranges ([`Span`]); the protocol counts lines from 0 and
//! columns in UTF-16 code units (its default `positionEncoding`, the only one every
//! client speaks), so a `é` is one column and a `🦀` two. [`LineIndex`] keeps the byte
//! offset of every line start so each conversion walks one line only.

use crate::span::Span;
use lsp_types::{Position, Range};

/// The line starts of one text, for converting positions.
#[derive(Debug, Clone)]
pub struct LineIndex {
    /// Byte offset of the first byte of every line (the first is 0).
    line_starts: Vec<usize>,
}

impl LineIndex {
    /// Indexes `text` (lines end at `\n`; a `\r` before it belongs to the line's text).
    pub fn new(text: &str) -> LineIndex {
        let mut line_starts = vec![0];
        line_starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        LineIndex { line_starts }
    }

    /// The position of byte `offset` of `text` (clamped to the text and moved back to a
    /// character boundary, so a span from a stale analysis never panics).
    pub fn position(&self, text: &str, offset: usize) -> Position {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let line = self.line_starts.partition_point(|&s| s <= offset) - 1;
        let start = self.line_starts[line];
        let character = text[start..offset].encode_utf16().count();
        Position::new(to_u32(line), to_u32(character))
    }

    /// The range of a span of `text`.
    pub fn range(&self, text: &str, span: Span) -> Range {
        Range::new(
            self.position(text, span.start as usize),
            self.position(text, span.end as usize),
        )
    }

    /// The byte offset of `position` in `text`: `None` past the last line; a column past
    /// the end of its line is the line's end (clients may send one, the protocol says to
    /// treat it so), and a column inside a surrogate pair is the character's start.
    pub fn offset(&self, text: &str, position: Position) -> Option<usize> {
        let line = usize::try_from(position.line).ok()?;
        let start = *self.line_starts.get(line)?;
        let end = self
            .line_starts
            .get(line + 1)
            .map_or(text.len(), |next| next - 1);
        let wanted = usize::try_from(position.character).unwrap_or(usize::MAX);
        let mut units = 0;
        for (i, c) in text[start..end].char_indices() {
            if units + c.len_utf16() > wanted {
                return Some(start + i);
            }
            units += c.len_utf16();
        }
        Some(end)
    }
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_count_utf16_units_and_round_trip() {
        // `é` is 2 bytes and 1 unit; `🦀` 4 bytes and 2 units.
        let text = "ab\n// é🦀 x\r\nlast";
        let index = LineIndex::new(text);
        let x = text.find('x').unwrap();
        assert_eq!(index.position(text, x), Position::new(1, 7));
        assert_eq!(index.offset(text, Position::new(1, 7)), Some(x));
        assert_eq!(index.position(text, 0), Position::new(0, 0));
        let last = text.find("last").unwrap();
        assert_eq!(index.position(text, last), Position::new(2, 0));
        assert_eq!(index.position(text, text.len()), Position::new(2, 4));
        // Between the crab's two units (column 5): the crab's start.
        let crab = text.find('🦀').unwrap();
        assert_eq!(index.offset(text, Position::new(1, 5)), Some(crab));
        // Past the line's end: the end (before the newline); past the last line: none.
        assert_eq!(index.offset(text, Position::new(0, 99)), Some(2));
        assert_eq!(index.offset(text, Position::new(3, 0)), None);
        // An offset inside a character moves back to its start.
        assert_eq!(index.position(text, crab + 1), Position::new(1, 4));
    }
}
