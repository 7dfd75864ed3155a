//! MoE-Infinity's expert activation matrices (paper §4.3-4.5): per running request, an
//! `L x E` count of tokens routed to each expert (its rEAM, prefill and decode together);
//! a bounded collection of finished requests' matrices; and the prediction made by
//! matching the running requests' matrix against that collection.
//!
//! Takes routing per request after every step and each request's end; gives, for a
//! layer, each expert's predicted activation (the nearest collected matrix by cosine
//! similarity, its row normalised). The collection holds at most `capacity` matrices; a
//! new one replaces the most similar entry when full (App. B.1: recency and diversity).
//! It can be seeded from the matrices `moec profile` wrote. Predictions decide only what
//! is prefetched and evicted, never what is computed.

use std::collections::HashMap;

/// Matrices kept when the schedule does not say (the paper's Fig. 9 goes up to 120).
pub const DEFAULT_CAPACITY: usize = 120;

/// The activation matrices of one run.
#[derive(Debug, Clone, Default)]
pub struct Eam {
    layers: usize,
    experts: usize,
    capacity: usize,
    /// Finished requests' matrices, flattened `layer * experts + expert`.
    collection: Vec<Vec<f32>>,
    /// Running requests' matrices (request index -> counts).
    running: HashMap<usize, Vec<u32>>,
}

impl Eam {
    /// An empty collection for a model.
    pub fn new(layers: usize, experts: usize, capacity: usize) -> Self {
        Eam {
            layers,
            experts,
            capacity: capacity.max(1),
            collection: Vec::new(),
            running: HashMap::new(),
        }
    }

    /// Matrices in the collection.
    pub fn collected(&self) -> usize {
        self.collection.len()
    }

    /// Adds `tokens` routed to `expert` of `layer` by `request`.
    pub fn record(&mut self, request: usize, layer: u32, expert: u32, tokens: u32) {
        let (l, e) = (layer as usize, expert as usize);
        if l >= self.layers || e >= self.experts {
            return;
        }
        let cells = self.layers * self.experts;
        let m = self
            .running
            .entry(request)
            .or_insert_with(|| vec![0; cells]);
        m[l * self.experts + e] = m[l * self.experts + e].saturating_add(tokens);
    }

    /// A request finished: its matrix joins the collection (and is returned, for
    /// `moec profile` to keep).
    pub fn finish(&mut self, request: usize) -> Option<Vec<u64>> {
        let m = self.running.remove(&request)?;
        self.insert(m.iter().map(|&c| c as f32).collect());
        Some(m.iter().map(|&c| u64::from(c)).collect())
    }

    /// Seeds the collection with matrices (each `layers * experts` counts; others are
    /// skipped).
    pub fn seed(&mut self, matrices: &[Vec<u64>]) {
        for m in matrices {
            if m.len() == self.layers * self.experts {
                self.insert(m.iter().map(|&c| c as f32).collect());
            }
        }
    }

    fn insert(&mut self, m: Vec<f32>) {
        if m.iter().all(|&c| c == 0.0) {
            return;
        }
        if self.collection.len() < self.capacity {
            self.collection.push(m);
            return;
        }
        if let Some(i) = self.nearest(&m) {
            self.collection[i] = m;
        }
    }

    /// Index of the collected matrix most similar to `current` (largest cosine).
    fn nearest(&self, current: &[f32]) -> Option<usize> {
        let norm = |v: &[f32]| {
            v.iter()
                .map(|x| f64::from(*x) * f64::from(*x))
                .sum::<f64>()
                .sqrt()
        };
        let cn = norm(current);
        self.collection
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let dot: f64 = m
                    .iter()
                    .zip(current)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let denom = norm(m) * cn;
                (i, if denom > 0.0 { dot / denom } else { 0.0 })
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i)
    }

    /// The matrix of the given running requests plus `step` (this step's routing so far,
    /// `layers * experts` counts).
    pub fn current(&self, requests: &[usize], step: &[u32]) -> Vec<f32> {
        let mut m: Vec<f32> = step.iter().map(|&c| c as f32).collect();
        m.resize(self.layers * self.experts, 0.0);
        for r in requests {
            if let Some(counts) = self.running.get(r) {
                for (x, c) in m.iter_mut().zip(counts) {
                    *x += *c as f32;
                }
            }
        }
        m
    }

    /// PredictEAM: the nearest collected matrix's rows, each normalised to sum 1 (all
    /// layers, `layers x experts`); `None` with an empty collection or an all-zero
    /// current matrix (nothing to match yet).
    pub fn predict(&self, current: &[f32]) -> Option<Vec<Vec<f64>>> {
        if current.iter().all(|&c| c == 0.0) {
            return None;
        }
        let m = &self.collection[self.nearest(current)?];
        Some(
            m.chunks(self.experts.max(1))
                .map(|row| {
                    let sum: f64 = row.iter().map(|&c| f64::from(c)).sum();
                    row.iter()
                        .map(|&c| if sum > 0.0 { f64::from(c) / sum } else { 0.0 })
                        .collect()
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_matrix_by_cosine_predicts_and_a_full_collection_replaces_the_most_similar() {
        // 2 layers x 2 experts. Request 0 prefers expert 0, request 1 expert 1.
        let mut eam = Eam::new(2, 2, 2);
        eam.record(0, 0, 0, 3);
        eam.record(0, 1, 0, 3);
        eam.record(1, 0, 1, 4);
        eam.record(1, 1, 1, 2);
        eam.record(1, 1, 0, 2);
        eam.finish(0);
        eam.finish(1);
        assert_eq!(eam.collected(), 2);
        // A current matrix leaning to expert 1 of layer 0 matches request 1: its layer-1
        // row [2, 2] normalises to [0.5, 0.5].
        let p = eam.predict(&[0.0, 1.0, 0.0, 0.0]).expect("a match");
        assert_eq!(p[0], vec![0.0, 1.0]);
        assert_eq!(p[1], vec![0.5, 0.5]);
        // Full: a third matrix like request 0's replaces request 0's, not request 1's.
        eam.record(2, 0, 0, 1);
        eam.record(2, 1, 0, 5);
        eam.finish(2);
        assert_eq!(eam.collected(), 2);
        let p = eam.predict(&[1.0, 0.0, 0.0, 0.0]).expect("a match");
        assert_eq!(p[1], vec![1.0, 0.0]);
        let p = eam.predict(&[0.0, 1.0, 0.0, 0.0]).expect("a match");
        assert_eq!(p[1], vec![0.5, 0.5]);
    }

    #[test]
    fn nothing_is_predicted_before_anything_was_collected_or_routed() {
        let mut eam = Eam::new(1, 2, 4);
        assert!(eam.predict(&[1.0, 0.0]).is_none());
        eam.record(0, 0, 1, 1);
        eam.finish(0);
        assert!(eam.predict(&[0.0, 0.0]).is_none());
        assert_eq!(eam.predict(&[0.0, 1.0]), Some(vec![vec![0.0, 1.0]]));
    }
}
