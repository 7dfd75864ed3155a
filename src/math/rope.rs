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

    /// The table of an architecture: plain, or with YaRN scaling when the card has it.
    pub fn for_arch(arch: &crate::model::arch::ArchSpec, max_positions: usize) -> Self {
        match &arch.yarn {
            None => Self::new(arch.rope_theta, arch.rope_dim(), max_positions),
            Some(y) => Self::yarn(arch.rope_theta, arch.rope_dim(), max_positions, y),
        }
    }

    /// YaRN tables as transformers' `_compute_yarn_parameters` builds them: frequencies
    /// `base^(2i/d)` in f32, extrapolated (`1/f`) and interpolated (`1/(factor f)`) ones
    /// blended by `1 - clamp((i - low) / (high - low), 0, 1)` between the correction
    /// dimensions of `beta_fast` and `beta_slow` rotations (computed in f64 as Python does),
    /// cos and sin multiplied by `0.1 ln(factor) + 1`.
    pub fn yarn(
        theta: f64,
        head_dim: usize,
        max_positions: usize,
        y: &crate::model::card::Yarn,
    ) -> Self {
        let half = head_dim / 2;
        let dim = head_dim as f64;
        let correction = |rotations: f64| {
            dim * (y.original_max_positions as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction(y.beta_fast), correction(y.beta_slow));
        if y.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001;
        }
        let (low, high) = (low as f32, high as f32);
        let factor = y.factor as f32;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let pos_freq = (theta as f32).powf((2 * i) as f32 / head_dim as f32);
                let extrapolation = 1.0 / pos_freq;
                let interpolation = 1.0 / (factor * pos_freq);
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation_share = 1.0 - ramp;
                interpolation * (1.0 - extrapolation_share) + extrapolation * extrapolation_share
            })
            .collect();
        let scaling = y.attention_factor() as f32;
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for &f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * scaling);
                sin.push(angle.sin() * scaling);
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

    /// Rotates one head whose rotary pairs are adjacent, `(x0, x1), (x2, x3), ...`
    /// (DeepSeek's layout: transformers' complex product in V2, `rope_interleave` in V3),
    /// pair `i` by frequency `i`, for `position` (< `max_positions`).
    pub fn rotate_interleaved(&self, head: &mut [f32], position: usize) {
        let half = self.half;
        let cos = &self.cos[position * half..(position + 1) * half];
        let sin = &self.sin[position * half..(position + 1) * half];
        for (i, pair) in head.chunks_exact_mut(2).take(half).enumerate() {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos[i] - b * sin[i];
            pair[1] = b * cos[i] + a * sin[i];
        }
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

    /// gpt-oss's YaRN on a 16-wide head (theta 1.5e5, factor 32, original 4096 positions,
    /// beta 32 / 1, no truncation), worked by hand: the correction dimensions are
    /// low = 16 ln(4096 / (32 * 2 pi)) / (2 ln 1.5e5) = 2.0218 and
    /// high = 16 ln(4096 / (2 pi)) / (2 ln 1.5e5) = 4.3499, so frequencies 0-2 keep
    /// `theta^(-2i/16)` (extrapolation), 5-7 are divided by 32 (interpolation), 3 and 4
    /// blend with ramp (i - low) / (high - low); cos and sin are scaled by
    /// 0.1 ln 32 + 1 = 1.346574.
    #[test]
    fn yarn_frequencies_and_scale_match_hand_computation() {
        let y = crate::model::card::Yarn {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_positions: 4096,
            truncate: false,
            mscale: None,
        };
        let table = RopeTable::yarn(150000.0, 16, 2, &y);
        let (cos, sin) = table.tables();
        let scale = 1.346_574_f64;
        let (low, high) = (2.021_8_f64, 4.349_9_f64);
        for i in 0..8 {
            let base = 150000f64.powf(-((2 * i) as f64) / 16.0);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let f = base / 32.0 * ramp + base * (1.0 - ramp);
            // Position 1: angle = f.
            let (c, s) = (cos[8 + i] as f64, sin[8 + i] as f64);
            assert!((c - f.cos() * scale).abs() < 1e-4, "cos {i}: {c}");
            assert!((s - f.sin() * scale).abs() < 1e-4, "sin {i}: {s}");
            // Position 0: cos = the scale itself, sin = 0.
            assert!((cos[i] as f64 - scale).abs() < 1e-5 && sin[i] == 0.0);
        }
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
