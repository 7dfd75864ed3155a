//! Task labels as the elaborator keys them: `name[i, j]` within one step.
//!
//! Takes a label's name and its evaluated indices; gives a key that hashes and compares
//! without formatting (the labelled tasks of a real-size schedule number in the millions
//! per plan) and the label's text (`on_cpu[3, 0, 17]`), formatted once for the task.
//! Guarantees: two keys are equal exactly when their texts and steps are.

use smallvec::SmallVec;
use std::fmt::Write as _;

/// A label within its step (`after` never crosses step boundaries).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct LabelKey<'a> {
    /// The step the label is declared in.
    pub step: u32,
    /// The name as written.
    pub name: &'a str,
    /// The evaluated indices (none for a plain name).
    pub indices: SmallVec<[i64; 4]>,
}

impl LabelKey<'_> {
    /// The label as written with its indices evaluated: `name` or `name[i, j]`.
    pub fn text(&self) -> String {
        if self.indices.is_empty() {
            return self.name.to_string();
        }
        let mut text = String::with_capacity(self.name.len() + 2 + 6 * self.indices.len());
        text.push_str(self.name);
        text.push('[');
        for (k, index) in self.indices.iter().enumerate() {
            if k > 0 {
                text.push_str(", ");
            }
            // Writing to a String cannot fail.
            let _ = write!(text, "{index}");
        }
        text.push(']');
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_is_the_label_as_written_with_its_indices_evaluated() {
        let key = |indices: &[i64]| LabelKey {
            step: 1,
            name: "on_cpu",
            indices: indices.iter().copied().collect(),
        };
        assert_eq!(key(&[]).text(), "on_cpu");
        assert_eq!(key(&[3, 0, -17]).text(), "on_cpu[3, 0, -17]");
        assert_eq!(key(&[1, 2, 3, 4, 5]).text(), "on_cpu[1, 2, 3, 4, 5]");
        assert_ne!(key(&[1, 23]), key(&[12, 3]));
    }
}
