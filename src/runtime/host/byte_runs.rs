//! Byte runs of a copy: the span a list of `(offset, len)` runs covers, the weight labels
//! a copy of those runs carries along, and the parts of the runs no label covers (what a
//! bound copy still has to move). Plain functions on sorted, disjoint lists, shared by the
//! host memory ([`super::memory`]) and the CUDA backend's.

use super::memory::{MemoryError, View};
use super::weights::WeightTag;

/// The span `(first, end)` that `runs` (offsets from both views' starts, sorted) cover, or
/// `None` for no runs; an error names the first run past the shorter view.
pub(crate) fn runs_span(
    runs: &[(u64, u64)],
    src: View,
    dst: View,
) -> Result<Option<(u64, u64)>, MemoryError> {
    let (Some(&(first, _)), Some(end)) = (runs.first(), runs.iter().map(|r| r.0 + r.1).max())
    else {
        return Ok(None);
    };
    let within = src.len.min(dst.len);
    if let Some(&(offset, len)) = runs
        .iter()
        .find(|(offset, len)| offset.saturating_add(*len) > within)
    {
        return Err(MemoryError::RunOutside {
            offset,
            len,
            view: within,
        });
    }
    Ok(Some((first, end)))
}

/// The labels `span` (offsets from `base`, sorted and disjoint: a weight map's pieces)
/// clipped to `runs` (offsets from the view's start, sorted and disjoint), as offsets from
/// the view's start: what a copy of the runs carries along.
pub(crate) fn clip_to_runs(
    span: &[(u64, u64, WeightTag, u64)],
    base: u64,
    runs: &[(u64, u64)],
) -> Vec<(u64, u64, WeightTag, u64)> {
    let mut out = Vec::new();
    let mut rest = runs;
    for &(offset, len, tag, tag_offset) in span {
        let (lo, hi) = (base + offset, base + offset + len);
        // Runs that end at or before this label cannot meet a later one either.
        while rest.first().is_some_and(|&(at, n)| at + n <= lo) {
            rest = &rest[1..];
        }
        for &(at, n) in rest {
            if at >= hi {
                break;
            }
            let (a, b) = (lo.max(at), hi.min(at + n));
            if a < b {
                out.push((a, b - a, tag, tag_offset + (a - lo)));
            }
        }
    }
    out
}

/// The parts of `runs` (offset, length; sorted and disjoint) no label covers, as
/// `(start, end)` offsets; `labels` are sorted, disjoint and lie inside the runs.
pub(super) fn unlabelled_runs(
    labels: &[(u64, u64, WeightTag, u64)],
    runs: &[(u64, u64)],
) -> Vec<(u64, u64)> {
    let mut gaps = Vec::with_capacity(runs.len());
    let mut labels = labels.iter().peekable();
    for &(start, len) in runs {
        let end = start + len;
        let mut at = start;
        while let Some(&&(offset, n, _, _)) = labels.peek() {
            if offset >= end {
                break;
            }
            if offset > at {
                gaps.push((at, offset));
            }
            at = at.max(offset + n);
            labels.next();
        }
        if at < end {
            gaps.push((at, end));
        }
    }
    gaps
}

#[cfg(test)]
mod tests {
    use super::{clip_to_runs, unlabelled_runs, WeightTag};

    /// A copy of 100 bytes whose labels cover 10..30 and 30..50 (two tensors) and 80..100
    /// moves 0..10, 50..80 only; with several runs, each run's own gaps.
    #[test]
    fn binding_copies_only_the_bytes_no_weight_label_covers() {
        let labels = [
            (10, 20, WeightTag::Embed, 0),
            (30, 20, WeightTag::LmHead, 0),
            (80, 20, WeightTag::FinalNorm, 5),
        ];
        assert_eq!(
            unlabelled_runs(&labels, &[(0, 100)]),
            vec![(0, 10), (50, 80)]
        );
        assert_eq!(unlabelled_runs(&[], &[(0, 7)]), vec![(0, 7)]);
        assert_eq!(
            unlabelled_runs(&[(0, 7, WeightTag::Embed, 0)], &[(0, 7)]),
            vec![]
        );
        // Runs 0..20 and 40..60 with labels 10..20 and 40..45: gaps 0..10 and 45..60.
        let labels = [(10, 10, WeightTag::Embed, 0), (40, 5, WeightTag::LmHead, 0)];
        assert_eq!(
            unlabelled_runs(&labels, &[(0, 20), (40, 20)]),
            vec![(0, 10), (45, 60)]
        );
    }

    /// Labels of a span that starts at byte 100 of the view (an embedding label over
    /// 100..135 and a final-norm one over 145..155), clipped to runs 100..110 and 130..150:
    /// 100..110 and 130..135 of the embedding, each with its own offset into the tensor,
    /// and 145..150 of the norm.
    #[test]
    fn labels_are_clipped_to_the_runs() {
        let span = [
            (0, 35, WeightTag::Embed, 7),
            (45, 10, WeightTag::FinalNorm, 0),
        ];
        assert_eq!(
            clip_to_runs(&span, 100, &[(100, 10), (130, 20)]),
            vec![
                (100, 10, WeightTag::Embed, 7),
                (130, 5, WeightTag::Embed, 37),
                (145, 5, WeightTag::FinalNorm, 0),
            ]
        );
    }
}
