//! Task labels as the elaborator keys them: `name[i, j]` within one step.
//!
//! Takes a label's name and its evaluated indices; gives a key that hashes and compares
//! without formatting (the labelled tasks of a real-size schedule number in the millions
//! per plan) and the label's text (`on_cpu[3, 0, 17]`), formatted once for the task.
//! Guarantees: two keys are equal exactly when their texts and steps are.

use super::scopes::{fast_map, FastMap};
use crate::ir::TaskId;
use smallvec::SmallVec;
use std::collections::hash_map::Entry;
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

/// Every label of a program with its task: what `after` resolves against and what a
/// duplicate is found in.
///
/// A real-size plan keys a label per task (half a million per point), so a key is held in
/// 16 bytes where it fits: its name interned, its step and up to four indices in
/// `0..2^20` packed into two words ([`LabelKey`]s that do not fit, in a map of their own:
/// a key goes to exactly one of the two, so equal keys meet). The table is a quarter of
/// the size of one keyed by [`LabelKey`], and hashing and comparing a key touches no
/// string.
///
/// A planner's point (a lean elaboration, `Options::task_names` false) does not insert its
/// packed keys into a map as they come: a random insert per task into a table of a million
/// keys was most of a label's cost (cache misses). They are listed in issue order and
/// sorted once when the steps are done ([`Labels::seal`]), which finds any key given twice;
/// then the elaboration is run again with keys checked as they come, so the diagnostic
/// (and everything that follows from it) is the one an eager table gives.
pub(super) struct Labels<'a> {
    /// Each label name's number, in order of first use.
    names: FastMap<&'a str, u32>,
    /// Keys that pack.
    packed: FastMap<(u64, u64), TaskId>,
    /// Keys that do not.
    other: FastMap<LabelKey<'a>, TaskId>,
    /// Deferred labels: keys that pack, with their tasks, in issue order until sealed,
    /// then sorted by key. `None`: keys go to `packed` as they come.
    deferred: Option<Vec<((u64, u64), TaskId)>>,
    /// Set by [`Labels::seal`]: whether no deferred key was given twice.
    sealed: Option<bool>,
}

/// Bits per packed index.
const INDEX_BITS: u32 = 20;

impl<'a> Labels<'a> {
    /// No labels; each key is checked against the others as it is inserted.
    pub(super) fn new() -> Self {
        Labels {
            names: fast_map(),
            packed: fast_map(),
            other: fast_map(),
            deferred: None,
            sealed: None,
        }
    }

    /// No labels; keys that pack are checked for duplicates only by [`Labels::seal`],
    /// which must be called before [`Labels::get`]. (Elaborations start from a list
    /// kept for them: [`Labels::deferred_in`].)
    #[cfg(test)]
    pub(super) fn deferred() -> Self {
        Labels {
            deferred: Some(Vec::new()),
            ..Labels::new()
        }
    }

    /// [`Labels::deferred`] whose list starts from `list` (emptied here; its capacity
    /// kept: a planner's points on one thread reuse one list).
    pub(super) fn deferred_in(mut list: Vec<((u64, u64), TaskId)>) -> Self {
        list.clear();
        Labels {
            deferred: Some(list),
            ..Labels::new()
        }
    }

    /// The deferred list, taken (for the next elaboration on this thread): empty for eager
    /// labels. Labels are not read after this.
    pub(super) fn take_list(&mut self) -> Vec<((u64, u64), TaskId)> {
        self.deferred.take().unwrap_or_default()
    }

    /// Ends insertion: sorts the deferred keys (once; later calls give the same answer).
    /// `false` when a deferred key was inserted twice (its second insert answered `Ok`:
    /// the caller elaborates again with [`Labels::new`] to report it where it occurs).
    /// Always `true` for eager labels.
    pub(super) fn seal(&mut self) -> bool {
        if let Some(sealed) = self.sealed {
            return sealed;
        }
        let unique = match &mut self.deferred {
            Some(list) => {
                // Unstable (in place, no scratch table of half the list): equal keys only
                // matter when there are some, and then the elaboration runs again with
                // eager labels, which never reads this list.
                list.sort_unstable_by_key(|&(key, _)| key);
                list.windows(2).all(|pair| pair[0].0 != pair[1].0)
            }
            None => true,
        };
        self.sealed = Some(unique);
        unique
    }

    /// `key` in two words, with its name numbered `name`; `None` when it does not fit.
    fn pack(key: &LabelKey<'_>, name: u32) -> Option<(u64, u64)> {
        let limit = 1i64 << INDEX_BITS;
        if key.indices.len() > 4
            || key.step >= 1 << 12
            || name >= 1 << 12
            || key.indices.iter().any(|&i| !(0..limit).contains(&i))
        {
            return None;
        }
        // Word 0: step, name, index count, first index; word 1: the other three.
        let at = |k: usize| key.indices.get(k).map_or(0, |&i| i as u64);
        let head = u64::from(key.step)
            | u64::from(name) << 12
            | (key.indices.len() as u64) << 24
            | at(0) << 27;
        let tail = at(1) | at(2) << INDEX_BITS | at(3) << (2 * INDEX_BITS);
        Some((head, tail))
    }

    /// The task labelled `key`, if any.
    pub(super) fn get(&self, key: &LabelKey<'_>) -> Option<TaskId> {
        let &name = self.names.get(key.name)?;
        match (Self::pack(key, name), &self.deferred) {
            (Some(packed), Some(list)) => {
                debug_assert!(self.sealed.is_some(), "deferred labels read before seal");
                list.binary_search_by_key(&packed, |&(key, _)| key)
                    .ok()
                    .map(|at| list[at].1)
            }
            (Some(packed), None) => self.packed.get(&packed).copied(),
            (None, _) => self.other.get(key).copied(),
        }
    }

    /// Labels task `id` with `key`; `Err` with the task that already has the label.
    pub(super) fn insert(&mut self, key: &LabelKey<'a>, id: TaskId) -> Result<(), TaskId> {
        let count = self.names.len() as u32;
        let name = *self.names.entry(key.name).or_insert(count);
        let first = match Self::pack(key, name) {
            Some(packed) if self.deferred.is_some() => {
                if let Some(list) = &mut self.deferred {
                    list.push((packed, id));
                }
                None
            }
            Some(packed) => match self.packed.entry(packed) {
                Entry::Occupied(first) => Some(*first.get()),
                Entry::Vacant(slot) => {
                    slot.insert(id);
                    None
                }
            },
            None => match self.other.get(key) {
                Some(&first) => Some(first),
                None => {
                    self.other.insert(key.clone(), id);
                    None
                }
            },
        };
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal keys meet whether they pack or not; keys that differ in any part, or pack
    /// into neighbouring bits, do not.
    #[test]
    fn a_label_is_found_exactly_under_its_own_key() {
        let key = |step: u32, name: &'static str, indices: &[i64]| LabelKey {
            step,
            name,
            indices: indices.iter().copied().collect(),
        };
        let keys = [
            key(0, "a", &[]),
            key(1, "a", &[]),
            key(0, "b", &[]),
            key(0, "a", &[0]),
            key(0, "a", &[0, 0]),
            key(0, "a", &[1, 0]),
            key(0, "a", &[0, 1]),
            key(0, "a", &[(1 << 20) - 1, 5, 6, 7]),
            key(0, "a", &[1 << 20, 5, 6, 7]),
            key(0, "a", &[-1]),
            key(0, "a", &[1, 2, 3, 4, 5]),
            key(0, "a", &[1, 2, 3, 4]),
        ];
        let mut labels = Labels::new();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(labels.get(k), None, "{k:?}");
            assert_eq!(labels.insert(k, TaskId::new(i)), Ok(()), "{k:?}");
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(labels.get(k), Some(TaskId::new(i)), "{k:?}");
            assert_eq!(labels.insert(k, TaskId::new(99)), Err(TaskId::new(i)));
        }
        assert_eq!(labels.get(&key(0, "c", &[])), None);
        assert_eq!(labels.get(&key(2, "a", &[])), None);
    }

    /// Deferred labels find what eager ones find once sealed (keys that pack and keys
    /// that do not), and a key given twice is found by the seal, not by the insert.
    #[test]
    fn deferred_labels_are_found_once_sealed_and_duplicates_by_the_seal() {
        let key = |step: u32, name: &'static str, indices: &[i64]| LabelKey {
            step,
            name,
            indices: indices.iter().copied().collect(),
        };
        // Out of key order on purpose: the seal sorts them.
        let keys = [
            key(1, "a", &[3, 0, 17]),
            key(0, "a", &[3, 0, 17]),
            key(0, "b", &[]),
            key(0, "a", &[0, 1]),
            key(0, "a", &[1, 0]),
            key(0, "a", &[1 << 20, 5]),
            key(0, "a", &[1, 2, 3, 4, 5]),
        ];
        let mut labels = Labels::deferred();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(labels.insert(k, TaskId::new(i)), Ok(()), "{k:?}");
        }
        assert!(labels.seal());
        assert!(labels.seal(), "sealing again gives the same answer");
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(labels.get(k), Some(TaskId::new(i)), "{k:?}");
        }
        assert_eq!(labels.get(&key(0, "a", &[3, 0, 18])), None);
        assert_eq!(labels.get(&key(2, "a", &[3, 0, 17])), None);
        assert_eq!(labels.get(&key(0, "c", &[])), None);

        let mut twice = Labels::deferred();
        assert_eq!(twice.insert(&keys[0], TaskId::new(0)), Ok(()));
        assert_eq!(twice.insert(&keys[3], TaskId::new(1)), Ok(()));
        assert_eq!(twice.insert(&keys[0], TaskId::new(2)), Ok(()));
        assert!(!twice.seal());
        // A key that does not pack is still checked as it comes.
        let mut other = Labels::deferred();
        assert_eq!(other.insert(&keys[5], TaskId::new(0)), Ok(()));
        assert_eq!(other.insert(&keys[5], TaskId::new(1)), Err(TaskId::new(0)));
        assert!(Labels::new().seal());
    }

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
