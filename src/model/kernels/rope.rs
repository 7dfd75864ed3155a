//! Rotary position embeddings in the NeoX ("rotate_half") layout that the Hugging Face
//! Mixtral and DBRX checkpoints use.
//!
//! Takes a rotary base and head width; gives f32 cos/sin tables built as transformers
//! builds them (`inv_freq = 1 / theta^(2i/d)` in f32, angle = position * inv_freq in f32)
//! and rotates heads in place. Positions past the table are an error for the caller to
//! prevent ([`RopeTable::max_positions`]).

/// Precomputed `cos`/`sin` of every (position, frequency) pair.
#[derive(Debug, Clone)]
pub struct RopeTable {
    half: usize,
    max_positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds tables for `max_positions` positions of heads `head_dim` wide.
    pub fn new(theta: f64, head_dim: usize, max_positions: usize) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                1.0 / (theta as f32).powf(exponent)
            })
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for &f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        RopeTable {
            half,
            max_positions,
            cos,
            sin,
        }
    }

    /// Positions the table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The cosine and sine tables, `[max_positions, head_dim / 2]` each, row per position:
    /// a device backend uploads these exact values so its rotary agrees with this one.
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Rotates one head (`2 * half` values) for `position` (< `max_positions`).
    pub fn rotate(&self, head: &mut [f32], position: usize) {
        let half = self.half;
        let cos = &self.cos[position * half..(position + 1) * half];
        let sin = &self.sin[position * half..(position + 1) * half];
        let (lo, hi) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (lo[i], hi[i]);
            lo[i] = a * cos[i] - b * sin[i];
            hi[i] = b * cos[i] + a * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With head_dim 2 the only frequency is 1: a plain 2-D rotation by `position` radians.
    #[test]
    fn two_dim_head_rotates_by_position_radians() {
        let table = RopeTable::new(10000.0, 2, 8);
        let mut head = [1.0f32, 0.0];
        table.rotate(&mut head, 3);
        assert!((head[0] - 3f32.cos()).abs() < 1e-6 && (head[1] - 3f32.sin()).abs() < 1e-6);
    }

    /// Rotation preserves the norm of each (i, i + half) pair.
    #[test]
    fn rotation_preserves_pair_norms() {
        let table = RopeTable::new(1e6, 8, 64);
        let mut head = [0.3f32, -1.0, 2.0, 0.5, 1.5, 0.25, -0.75, 1.0];
        let before: Vec<f32> = (0..4).map(|i| head[i].hypot(head[i + 4])).collect();
        table.rotate(&mut head, 63);
        for i in 0..4 {
            assert!((head[i].hypot(head[i + 4]) - before[i]).abs() < 1e-5);
        }
    }
}
