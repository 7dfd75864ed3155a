//! Products from the tiles of eight rows ([`crate::quant::tiles`], the layout): the
//! activation side the SIMD bodies read ([`TileActs`]), the portable body, and where the
//! CPU backend's tiles come from ([`mode`]: packed as products run, repacked at load, or
//! none). The products compute each output exactly as
//! [`super::matmul`] documents, so they give the plain layout's bits in every body.

use super::dot;
use crate::quant::q8::Q8Rows;
use crate::quant::tiles::{column_spans, untile_block};
pub use crate::quant::tiles::{columns, tile, tile_bytes, tileable, untile, TILE_BYTES, TILE_ROWS};
use crate::quant::{QuantFormat, QK_K};

/// Where the CPU backend's products get the tiles of eight rows they compute from
/// (`MOEC_QUANT_TILES`, read once). Every mode gives the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TileMode {
    /// Only Q4_K and MXFP4 repacked at load ([`tiled_at_load`]); the other formats' products of at
    /// least [`pack_min_rows`] activation rows pack each panel of the row layout into
    /// tiles as they run (`super::pack`), and fewer rows read the row layout in place. The
    /// default (`pack`, or unset).
    Pack,
    /// Q4_K, Q6_K, Q8_0, Q4_0 and MXFP4 matrices repacked into tiles once at load, in new
    /// memory as large as them (`load`; `on` is the same, its name before `pack` existed).
    Load,
    /// The row layout everywhere, never tiles (`off`, for comparing).
    Off,
}

impl TileMode {
    /// The `MOEC_QUANT_TILES` value that selects this mode.
    pub fn name(self) -> &'static str {
        match self {
            TileMode::Pack => "pack",
            TileMode::Load => "load",
            TileMode::Off => "off",
        }
    }
}

/// From how many activation rows a product from a matrix of `format` packs its panels in
/// [`TileMode::Pack`] (`usize::MAX`: never, a format without tiles). Below it the row
/// layout's bodies run in place. Chosen from `QUANT_BENCH_PACK=1 cargo bench --bench
/// quant` (DeepSeek-V2-Lite's prefill shapes, one thread, weights from DRAM; session 26
/// in docs/performance.md): the row layout of the 32-weight formats is 3-5x slower than
/// their tiles from 4 rows, so they pack from there; Q6_K's row layout is within 1.04-1.2x
/// of its tiles at 32-48 rows, less than the pack costs (about one more pass over the
/// weights at 3-4 GB/s), and 1.2-1.3x at 128; Q4_K's 1.3-1.5x from 16 rows, which the pack
/// repays from about 64.
pub fn pack_min_rows(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Mxfp4 => 4,
        QuantFormat::Q4K => 64,
        QuantFormat::Q6K => 128,
        _ => usize::MAX,
    }
}

/// The process's [`TileMode`] from `MOEC_QUANT_TILES` (`pack`, `load` or `on`, `off`; unset:
/// `pack`; any other value warns once and packs).
pub fn mode() -> TileMode {
    static MODE: std::sync::OnceLock<TileMode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("MOEC_QUANT_TILES").as_deref() {
        Err(_) | Ok("pack") => TileMode::Pack,
        Ok("load") | Ok("on") => TileMode::Load,
        Ok("off") => TileMode::Off,
        Ok(other) => {
            eprintln!(
                "warning: MOEC_QUANT_TILES={other} is not pack, load (on) or off; packing \
                 tiles as products run"
            );
            TileMode::Pack
        }
    })
}

/// [`pack_min_rows`] in words: `4 (Q8_0, Q4_0, MXFP4), 64 (Q4_K), 128 (Q6_K)`.
pub fn pack_thresholds() -> String {
    format!(
        "{} (Q8_0, Q4_0, MXFP4), {} (Q4_K), {} (Q6_K)",
        pack_min_rows(QuantFormat::Q8_0),
        pack_min_rows(QuantFormat::Q4K),
        pack_min_rows(QuantFormat::Q6K)
    )
}

/// Whether the CPU backend repacks a tileable matrix of `format` into tiles at load: every
/// format in [`TileMode::Load`], none in [`TileMode::Off`], and in [`TileMode::Pack`] only
/// Q4_K and MXFP4, whose few-row products (a decode step's) read their tiles faster than
/// their row layout: Q4_K 1.07x at one row, 1.4-1.6x at 4-8 (`QUANT_BENCH_PACK=1`;
/// OLMoE-1B-7B Q4_K_M's batch-1 decode 32.4 against 29.1 tok/s), MXFP4 2.0x at one row
/// (`moec probe`'s expert FFN points: 24.4 against 12.0 GB/s, Zen 4; gpt-oss's experts),
/// where Q6_K's and Q8_0's row layout is as fast as their tiles at one row
/// (docs/performance.md, session 26).
pub fn tiled_at_load(format: QuantFormat) -> bool {
    match mode() {
        TileMode::Load => true,
        TileMode::Pack => matches!(format, QuantFormat::Q4K | QuantFormat::Mxfp4),
        TileMode::Off => false,
    }
}

/// One line for the run report and `moec devices`: where the products' tiles come from.
pub fn describe_mode() -> String {
    match mode() {
        TileMode::Pack => format!(
            "quantised tiles: Q4_K and MXFP4 repacked at load, the other formats packed a panel of {} \
             rows at a time inside each product of >= {} activation rows \
             (MOEC_QUANT_TILES=pack, the default; =load repacks all at load)",
            super::matmul::PANEL_ROWS,
            pack_thresholds()
        ),
        TileMode::Load => "quantised tiles: Q4_K/Q6_K/Q8_0/Q4_0/MXFP4 matrices repacked at \
                           load (MOEC_QUANT_TILES=load)"
            .to_string(),
        TileMode::Off => {
            "quantised tiles: none, the row layout everywhere (MOEC_QUANT_TILES=off)".to_string()
        }
    }
}

/// What the MXFP4 tile bodies add to each table value (`kvalues_mxfp4`, −12..=12) so the
/// unsigned side of the dot-product instructions can take it (0..=24); the lanes start
/// from `−12 · Σ x` to take it off again.
pub(super) const MXFP4_OFFSET: i32 = 12;

/// The activation side the SIMD bodies read per (row, block), besides the codes.
///
/// Q4_K: the sums of each 32-code sub-block `s_j = bsum_2j + bsum_2j+1`, as `[s0, s0, s1,
/// s1, .., s7, s7]` (`wide`, the AVX-512 body: four per pair of sub-blocks) and as pairs
/// `s_2p | s_2p+1 << 16` (`pairs`, the AVX2 body). A sub-block sums at most 32 · 128, so
/// 16 bits hold it.
///
/// Q6_K: the `−32 · code` part of `(q − 32) · x` summed over the codes a body's lane
/// covers, so a lane can start from it and hold `Σ (q − 32) · x` directly: `quads`
/// (AVX-512: `−32 · Σ x` over each 4 consecutive codes, 64 per block) and `pairs16`
/// (AVX2: `−32 · (x_2m + x_2m+1 + x_8+2m + x_8+2m+1)` for each sub-block `c` (codes
/// `16c..`) and `m < 4`, 64 per block; at most 32 · 512 in magnitude, so 16 bits hold it),
/// and for the AVX2 unpacked pass (`super::tiles_unpacked_x86`) `sub16`: per sub-block
/// `c`, `−32 · Σ x` over its codes `16c + {0, 1, 4, 5, 8, 9, 12, 13}` in the low 16 bits
/// and over `16c + {2, 3, 6, 7, 10, 11, 14, 15}` in the high 16 (each at most 32 · 8 ·
/// 127 in magnitude), 16 per block.
pub(super) struct TileActs<'a> {
    /// The quantised rows (Q8_K).
    pub q: &'a Q8Rows,
    /// `q`'s blocks per row and values per block, kept so the bodies' per-block lookups
    /// multiply instead of dividing (`Q8Rows::blocks_per_row` divides on every call).
    nb: usize,
    be: usize,
    wide: Vec<i32>,
    pairs: Vec<i32>,
    quads: Vec<i32>,
    pairs16: Vec<i16>,
    sub16: Vec<i32>,
    block_offsets: Vec<i32>,
}

impl<'a> TileActs<'a> {
    /// What the bodies for `format` read of `q` (Q8_K rows): the AVX-512 VNNI body's sums
    /// when `vnni`, the AVX2 and portable bodies' otherwise.
    pub fn new(q: &'a Q8Rows, format: QuantFormat, vnni: bool) -> Self {
        let nb = q.blocks_per_row();
        let mut acts = TileActs {
            q,
            nb,
            be: q.format.block_elems(),
            wide: Vec::new(),
            pairs: Vec::new(),
            quads: Vec::new(),
            pairs16: Vec::new(),
            sub16: Vec::new(),
            block_offsets: Vec::new(),
        };
        if let Some(offset) = match format {
            // Only the VNNI pass reads Q8_0's offsets (the AVX2 pass takes signs instead).
            QuantFormat::Q8_0 if !vnni => return acts,
            QuantFormat::Q8_0 => Some(128),
            QuantFormat::Q4_0 => Some(8),
            QuantFormat::Mxfp4 => Some(MXFP4_OFFSET),
            _ => None,
        } {
            // Per 32-code block: lane `h` of a row's 64-bit group covers codes `8g + 4h..`
            // of every group `g` of eight.
            let nb32 = q.blocks_per_row();
            acts.block_offsets = vec![0i32; q.n_rows * nb32 * 2];
            for r in 0..q.n_rows {
                for b in 0..nb32 {
                    let x = q.block_qs(r, b);
                    for h in 0..2 {
                        let s: i32 = (0..4)
                            .flat_map(|g| x[8 * g + 4 * h..8 * g + 4 * h + 4].iter())
                            .map(|&v| i32::from(v))
                            .sum();
                        acts.block_offsets[(r * nb32 + b) * 2 + h] = -offset * s;
                    }
                }
            }
            return acts;
        }
        if format == QuantFormat::Q6K {
            // Only the sums the selected body reads: these run on the calling thread before
            // the product's parallel part, for every activation row.
            if vnni {
                acts.quads = vec![0i32; q.n_rows * nb * 64];
            } else {
                acts.pairs16 = vec![0i16; q.n_rows * nb * 64];
                acts.sub16 = vec![0i32; q.n_rows * nb * 16];
            }
            for r in 0..q.n_rows {
                for b in 0..nb {
                    let x = q.block_qs(r, b);
                    let at = (r * nb + b) * 64;
                    // Sums of the pairs of codes (2k, 2k + 1): every offset is made of them.
                    let mut two = [0i32; 128];
                    for (k, t) in two.iter_mut().enumerate() {
                        *t = i32::from(x[2 * k]) + i32::from(x[2 * k + 1]);
                    }
                    if vnni {
                        for k in 0..64 {
                            acts.quads[at + k] = -32 * (two[2 * k] + two[2 * k + 1]);
                        }
                        continue;
                    }
                    for c in 0..16 {
                        let p = &two[8 * c..8 * c + 8];
                        for m in 0..4 {
                            acts.pairs16[at + 4 * c + m] = (-32 * (p[m] + p[4 + m])) as i16;
                        }
                        // Pairs 0, 2, 4, 6 of the sub-block (codes 0-1, 4-5, ..) and 1, 3,
                        // 5, 7 (codes 2-3, 6-7, ..).
                        let even = -32 * (p[0] + p[2] + p[4] + p[6]);
                        let odd = -32 * (p[1] + p[3] + p[5] + p[7]);
                        acts.sub16[(r * nb + b) * 16 + c] =
                            ((even as u16 as u32) | ((odd as u16 as u32) << 16)) as i32;
                    }
                }
            }
            return acts;
        }
        acts.wide = vec![0i32; q.n_rows * nb * 16];
        acts.pairs = vec![0i32; q.n_rows * nb * 4];
        for r in 0..q.n_rows {
            for b in 0..nb {
                let s = q.block_bsums(r, b);
                let sub = |j: usize| i32::from(s[2 * j]) + i32::from(s[2 * j + 1]);
                let at = r * nb + b;
                for j in 0..8 {
                    acts.wide[at * 16 + 2 * j] = sub(j);
                    acts.wide[at * 16 + 2 * j + 1] = sub(j);
                }
                for p in 0..4 {
                    let packed =
                        (sub(2 * p) as u16 as u32) | ((sub(2 * p + 1) as u16 as u32) << 16);
                    acts.pairs[at * 4 + p] = packed as i32;
                }
            }
        }
        acts
    }

    /// Row `r`'s codes of block `b` (256 for Q8_K, 32 for Q8_0).
    pub fn codes(&self, r: usize, b: usize) -> &[i8] {
        let at = (r * self.nb + b) * self.be;
        &self.q.qs[at..at + self.be]
    }

    /// Row `r`'s scale of block `b` (`Q8Rows::block_d`).
    pub fn d(&self, r: usize, b: usize) -> f32 {
        self.q.d[r * self.nb + b]
    }

    /// Q4_K: row `r`'s sixteen wide sums of block `b`.
    pub fn wide(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.nb + b) * 16;
        &self.wide[at..at + 16]
    }

    /// Q4_K: row `r`'s four packed pairs of block `b`.
    pub fn pairs(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.nb + b) * 4;
        &self.pairs[at..at + 4]
    }

    /// Q6_K: row `r`'s 64 quad offsets of block `b`.
    pub fn quads(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.nb + b) * 64;
        &self.quads[at..at + 64]
    }

    /// Q8_0, Q4_0 and MXFP4: row `r`'s two lane offsets of (32-code) block `b`: `−128 · Σ x`
    /// (Q8_0), `−8 · Σ x` (Q4_0) or `−12 · Σ x` (MXFP4, [`MXFP4_OFFSET`]) over the codes `8g..8g + 4` and `8g + 4..8g + 8` of its
    /// four groups of eight.
    pub fn block_offsets(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.nb + b) * 2;
        &self.block_offsets[at..at + 2]
    }

    /// Q8_0, Q4_0 and MXFP4: row `r`'s lane offsets of every block ([`Self::block_offsets`]
    /// of block `b` at `2 b..2 b + 2`), for a body that walks the blocks with one pointer.
    pub fn row_block_offsets(&self, r: usize) -> &[i32] {
        let n = self.nb * 2;
        &self.block_offsets[r * n..(r + 1) * n]
    }

    /// Q6_K: row `r`'s 64 pair offsets of block `b`.
    pub fn pairs16(&self, r: usize, b: usize) -> &[i16] {
        let at = (r * self.nb + b) * 64;
        &self.pairs16[at..at + 64]
    }

    /// Q6_K (AVX2): row `r`'s 16 packed sub-block offsets of block `b`.
    pub fn sub16(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.nb + b) * 16;
        &self.sub16[at..at + 16]
    }
}

/// The reference body on tiles: each output's blocks read back plain ([`untile_block`])
/// and summed as [`super::matmul`] documents. Rows `o0..o0 + rows` (whole tiles) of the
/// tiled `[.., cols]` matrix `bytes` of `format` into `local[r * rows + i]`.
pub(super) fn portable_panel(
    format: QuantFormat,
    bytes: &[u8],
    cols: usize,
    acts: &Q8Rows,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    let bb = format.block_bytes();
    let row_bytes = cols / format.block_elems() * bb;
    let k_quant = acts.format == crate::quant::q8::ActFormat::Q8K;
    let mut group = vec![0u8; bb * QK_K / format.block_elems()];
    for t in 0..rows / TILE_ROWS {
        let tile_row = &bytes[(o0 + t * TILE_ROWS) * row_bytes..];
        for l in 0..TILE_ROWS {
            let i = t * TILE_ROWS + l;
            for r in 0..acts.n_rows {
                let mut acc = 0.0f32;
                let mut at = 0;
                for (first, k) in column_spans(format, cols) {
                    let tile = &tile_row[at..at + TILE_ROWS * k * bb];
                    at += tile.len();
                    let group = &mut group[..k * bb];
                    untile_block(format, tile, l, group);
                    for (j, block) in group.chunks_exact(bb).enumerate() {
                        let blk = first + j;
                        let bsums = if k_quant {
                            acts.block_bsums(r, blk)
                        } else {
                            &[]
                        };
                        let (dy, qs) = (acts.block_d(r, blk), acts.block_qs(r, blk));
                        acc += dot::block_value(format, block, qs, bsums, dy, 0.0);
                    }
                }
                local[r * rows + i] = acc;
            }
        }
    }
}
