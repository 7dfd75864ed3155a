//! Routing profiles: how many tokens a model routes to each (layer, expert) on a prompt
//! set, the offline input of popularity placement (Fiddler §3.4) and of expected
//! activation in the cost model.
//!
//! Takes the counts `moec profile` measured (or none: uniform routing); gives compile-time
//! rankings (`rank(l, e)` over every layer, `rank_in_layer(l, e)` within one) and each
//! expert's expected share of a layer's tokens. Guarantees: a ranking is a permutation
//! (ties, and a missing profile, break by expert then layer, Fiddler's placeholder order
//! "expert 0 of every layer first"), so a schedule placing the first n ranks in n slots
//! never gives two experts one slot; loading checks the dimensions against the card.

use serde::{Deserialize, Serialize};

/// Per-(layer, expert) routed token counts of one model over a prompt set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingProfile {
    /// The model card it was measured on.
    pub model: String,
    /// Tokens run through the model (prefill and decode tokens, every prompt).
    pub tokens: u64,
    /// `counts[layer][expert]`: tokens routed to that expert (each token counts once
    /// per expert of its top-k).
    pub counts: Vec<Vec<u64>>,
    /// `coactivation[layer][a][b]`: tokens routed to both a and b in that layer (a != b).
    #[serde(default)]
    pub coactivation: Vec<Vec<Vec<u64>>>,
    /// One expert activation matrix per finished request (`layers * experts` counts,
    /// layer-major: MoE-Infinity's rEAM), the `eam` predictor's collection.
    #[serde(default)]
    pub requests: Vec<Vec<u64>>,
}

/// Why a profile cannot be used with a card.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    /// Not valid JSON of the expected shape.
    #[error("not a routing profile: {0}")]
    Format(String),
    /// Its dimensions are not the card's.
    #[error("the profile has {got_layers} layers x {got_experts} experts, the model {layers} x {experts}")]
    Shape {
        /// The card's layers.
        layers: u64,
        /// The card's experts.
        experts: u64,
        /// The profile's layers.
        got_layers: usize,
        /// The profile's experts (of its first layer).
        got_experts: usize,
    },
}

impl RoutingProfile {
    /// Parses the JSON `moec profile` writes.
    pub fn from_json(text: &str) -> Result<Self, ProfileError> {
        serde_json::from_str(text).map_err(|e| ProfileError::Format(e.to_string()))
    }

    /// The JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Checks that every layer has `experts` counts and there are `layers` layers.
    pub fn check_shape(&self, layers: u64, experts: u64) -> Result<(), ProfileError> {
        let ok = self.counts.len() as u64 == layers
            && self.counts.iter().all(|c| c.len() as u64 == experts);
        if let Some((i, m)) = self
            .requests
            .iter()
            .enumerate()
            .find(|(_, m)| m.len() as u64 != layers.saturating_mul(experts))
        {
            return Err(ProfileError::Format(format!(
                "request activation matrix {i} has {} counts, not {layers} layers x {experts} experts",
                m.len()
            )));
        }
        if ok {
            Ok(())
        } else {
            Err(ProfileError::Shape {
                layers,
                experts,
                got_layers: self.counts.len(),
                got_experts: self.counts.first().map_or(0, Vec::len),
            })
        }
    }

    /// An empty profile of `layers` x `experts` for `model`.
    pub fn empty(model: &str, layers: u64, experts: u64) -> Self {
        let (l, e) = (layers as usize, experts as usize);
        RoutingProfile {
            model: model.to_string(),
            tokens: 0,
            counts: vec![vec![0; e]; l],
            coactivation: vec![vec![vec![0; e]; e]; l],
            requests: Vec::new(),
        }
    }

    /// Adds one gate's decisions: `experts` holds `top_k` choices per token, row by row.
    /// Tokens are counted at layer 0 (every token passes every layer once).
    pub fn add(&mut self, layer: u32, experts: &[u32], top_k: usize) {
        let k = top_k.max(1);
        let l = layer as usize;
        if l == 0 {
            self.tokens += (experts.len() / k) as u64;
        }
        for row in experts.chunks(k) {
            for (i, &a) in row.iter().enumerate() {
                if let Some(c) = self.counts.get_mut(l).and_then(|c| c.get_mut(a as usize)) {
                    *c += 1;
                }
                for &b in &row[i + 1..] {
                    for (x, y) in [(a, b), (b, a)] {
                        if let Some(c) = self
                            .coactivation
                            .get_mut(l)
                            .and_then(|m| m.get_mut(x as usize))
                            .and_then(|r| r.get_mut(y as usize))
                        {
                            *c += 1;
                        }
                    }
                }
            }
        }
    }

    fn count(&self, layer: u32, expert: u32) -> u64 {
        self.counts
            .get(layer as usize)
            .and_then(|c| c.get(expert as usize))
            .copied()
            .unwrap_or(0)
    }
}

/// Rank of `(layer, expert)` among every expert of every layer, most routed first (0 is
/// the most popular); ties and a missing profile in the order expert, then layer.
pub fn rank_over_layers(
    profile: Option<&RoutingProfile>,
    layers: u32,
    experts: u32,
    dense_layers: u32,
    layer: u32,
    expert: u32,
) -> u64 {
    // A leading dense layer has no routed expert to place: its experts rank after every
    // expert of every MoE layer, which rank among themselves.
    if layer < dense_layers {
        return u64::from(layers) * u64::from(experts);
    }
    let key = |l: u32, e: u32| {
        let count = profile.map_or(0, |p| p.count(l, e));
        (std::cmp::Reverse(count), e, l)
    };
    let me = key(layer, expert);
    // Counting the keys smaller than ours is the rank without sorting.
    (dense_layers..layers)
        .flat_map(|l| (0..experts).map(move |e| (l, e)))
        .filter(|&(l, e)| key(l, e) < me)
        .count() as u64
}

/// [`rank_over_layers`] of every `(layer, expert)` at once, at index
/// `layer * experts + expert`: one sort of the keys instead of one count over every key per
/// call (a schedule that places by `rank(l, e)` asks it for every expert of every layer in
/// every step, which counted `(layers x experts)^2` keys). Keys are distinct (expert and
/// layer break ties), so a key's rank is its place in the sorted order.
pub fn ranks_over_layers(
    profile: Option<&RoutingProfile>,
    layers: u32,
    experts: u32,
    dense_layers: u32,
) -> Vec<u64> {
    let after_all = u64::from(layers) * u64::from(experts);
    let mut ranks = vec![after_all; after_all as usize];
    let key = |l: u32, e: u32| {
        let count = profile.map_or(0, |p| p.count(l, e));
        (std::cmp::Reverse(count), e, l)
    };
    let mut keys: Vec<_> = (dense_layers.min(layers)..layers)
        .flat_map(|l| (0..experts).map(move |e| (l, e)))
        .map(|(l, e)| key(l, e))
        .collect();
    keys.sort_unstable();
    for (rank, &(_, e, l)) in keys.iter().enumerate() {
        ranks[l as usize * experts as usize + e as usize] = rank as u64;
    }
    ranks
}

/// Rank of `expert` among the experts of `layer`, most routed first; ties and a missing
/// profile by index.
pub fn rank_in_layer(
    profile: Option<&RoutingProfile>,
    experts: u32,
    layer: u32,
    expert: u32,
) -> u64 {
    let key = |e: u32| {
        (
            std::cmp::Reverse(profile.map_or(0, |p| p.count(layer, e))),
            e,
        )
    };
    let me = key(expert);
    (0..experts).filter(|&e| key(e) < me).count() as u64
}

/// The probability that a token routes to `(layer, expert)`: its share of the profiled
/// tokens, or `top_k / experts` (uniform routing) without a profile.
pub fn expected_share(
    profile: Option<&RoutingProfile>,
    top_k: u64,
    experts: u64,
    layer: u32,
    expert: u32,
) -> f64 {
    match profile {
        Some(p) if p.tokens > 0 => (p.count(layer, expert) as f64 / p.tokens as f64).min(1.0),
        _ => (top_k as f64 / experts.max(1) as f64).min(1.0),
    }
}

/// Reads a routing profile file (`--profile FILE`, written by `moec profile`) and checks it
/// has `card`'s layers and experts; errors name the file.
pub fn load_for_card(
    path: &std::path::Path,
    card: &crate::model::card::ModelCard,
) -> Result<std::sync::Arc<RoutingProfile>, String> {
    // A profile of the largest card is a few MB of counts; the config cap bounds a wrong
    // path (`/dev/zero`).
    let text = crate::textfile::read_capped(path, crate::textfile::CONFIG_LIMIT)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let profile =
        RoutingProfile::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    profile
        .check_shape(card.layers, card.experts)
        .map_err(|e| format!("{} does not fit {}: {e}", path.display(), card.name))?;
    Ok(std::sync::Arc::new(profile))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> RoutingProfile {
        // 2 layers x 3 experts, 10 tokens, top-2 (20 selections per layer).
        RoutingProfile {
            model: "test".into(),
            tokens: 10,
            counts: vec![vec![2, 9, 9], vec![10, 0, 10]],
            coactivation: Vec::new(),
            requests: Vec::new(),
        }
    }

    #[test]
    fn ranks_are_by_count_then_expert_then_layer() {
        let p = profile();
        // Over layers: (1,0)=10 and (1,2)=10 first (expert 0 before 2), then (0,1)=9,
        // (0,2)=9, then (0,0)=2, then (1,1)=0.
        let order: Vec<(u32, u32)> = {
            let mut all: Vec<((u32, u32), u64)> = (0..2)
                .flat_map(|l| (0..3).map(move |e| (l, e)))
                .map(|(l, e)| ((l, e), rank_over_layers(Some(&p), 2, 3, 0, l, e)))
                .collect();
            all.sort_by_key(|x| x.1);
            all.into_iter().map(|x| x.0).collect()
        };
        assert_eq!(order, vec![(1, 0), (1, 2), (0, 1), (0, 2), (0, 0), (1, 1)]);
        assert_eq!(rank_in_layer(Some(&p), 3, 0, 0), 2);
        assert_eq!(rank_in_layer(Some(&p), 3, 0, 1), 0);
        assert_eq!(rank_in_layer(Some(&p), 3, 0, 2), 1);
    }

    /// The table is the per-call rank for every key, with and without a profile, with
    /// and without leading dense layers.
    #[test]
    fn rank_table_equals_the_rank_of_each_key() {
        let p = profile();
        for profile in [Some(&p), None] {
            for dense in [0, 1] {
                let table = ranks_over_layers(profile, 2, 3, dense);
                for l in 0..2 {
                    for e in 0..3 {
                        assert_eq!(
                            table[(l * 3 + e) as usize],
                            rank_over_layers(profile, 2, 3, dense, l, e),
                            "{l} {e} dense {dense}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn without_a_profile_expert_zero_of_every_layer_comes_first() {
        let ranks: Vec<u64> = (0..3)
            .map(|e| rank_over_layers(None, 2, 3, 0, 1, e))
            .collect();
        // (0,0)=0, (1,0)=1, (0,1)=2, (1,1)=3, (0,2)=4, (1,2)=5.
        assert_eq!(ranks, vec![1, 3, 5]);
        assert!((expected_share(None, 2, 8, 0, 0) - 0.25).abs() < 1e-12);
        assert!((expected_share(Some(&profile()), 2, 3, 1, 1)).abs() < 1e-12);
    }

    #[test]
    fn adding_routing_counts_selections_pairs_and_tokens() {
        let mut p = RoutingProfile::empty("m", 2, 3);
        // Two tokens at layer 0 (top-2): {0, 2} and {2, 1}; one at layer 1: {1, 0}.
        p.add(0, &[0, 2, 2, 1], 2);
        p.add(1, &[1, 0], 2);
        assert_eq!(p.tokens, 2);
        assert_eq!(p.counts, vec![vec![1, 1, 2], vec![1, 1, 0]]);
        assert_eq!(p.coactivation[0][0][2], 1);
        assert_eq!(p.coactivation[0][2][0], 1);
        assert_eq!(p.coactivation[0][1][2], 1);
        assert_eq!(p.coactivation[0][0][1], 0);
        assert_eq!(p.coactivation[1][1][0], 1);
    }

    #[test]
    fn a_profile_of_another_shape_is_rejected() {
        assert!(profile().check_shape(2, 3).is_ok());
        assert!(profile().check_shape(4, 8).is_err());
        let text = profile().to_json();
        assert_eq!(RoutingProfile::from_json(&text), Ok(profile()));
        assert!(RoutingProfile::from_json("{").is_err());
    }
}
