//! Tiles made while a product runs: a many-row product from a matrix in ggml's row layout
//! repacks each panel of output rows it is about to compute into tiles of eight rows
//! ([`crate::quant::tiles::tile`], the routine a load-time repack uses) in a small buffer
//! of its own thread, and runs the tile bodies ([`super::tiles_x86`]) on it, as GEMM
//! libraries pack their panels.
//!
//! Why: repacking a whole checkpoint at load costs new memory as large as its matrices
//! (12.9 GiB for DeepSeek-V2-Lite in Q6_K, beside the file's 14.1 GB of page cache on a
//! 23 GiB machine) and most of the time to first token in page faults; the tile bodies'
//! speed is only needed when many activation rows share each weight (a prefill's), and
//! there one more read of a panel's weights is spread over all of them. A panel of 64
//! rows of a 2,048-wide Q6_K matrix is 105 KiB, so the bodies then read their tiles from
//! L2. Few-row products (a decode step's) read the row layout in place.
//!
//! Guarantees: the tiles are the load-time repack's bytes, so the outputs are the tile
//! bodies' bits, which are the row layout's (every body's, [`super::matmul`]). A panel's
//! rows past the matrix's last whole tile are packed with zero blocks after them and
//! their outputs dropped.

use super::matmul::QuantMatrix;
use super::select::{QuantBody, QuantKernels};
use super::tiles::{tile, TileActs, TILE_ROWS};
use crate::quant::QuantSlice;
use std::cell::RefCell;

/// Alignment of a packed panel in its buffer (a cache line: the load-time tile arena's
/// alignment, which the bodies' loads like).
const ALIGN: usize = 64;

/// One thread's packing buffers, kept between products so a prefill allocates them once
/// per thread.
#[derive(Default)]
struct Buffers {
    /// The panel's tiles (over-allocated by [`ALIGN`] to start on a cache line).
    tiled: Vec<u8>,
    /// A tail panel's plain rows, padded with zero blocks to whole tiles.
    plain: Vec<u8>,
    /// A tail panel's outputs for its padded rows.
    outputs: Vec<f32>,
}

thread_local! {
    static BUFFERS: RefCell<Buffers> = RefCell::new(Buffers::default());
}

/// The first `len` bytes of `buf` that start on an [`ALIGN`] boundary (grown as needed).
fn aligned(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if buf.len() < len + ALIGN {
        buf.resize(len + ALIGN, 0);
    }
    let skip = buf.as_ptr().align_offset(ALIGN).min(ALIGN);
    &mut buf[skip..skip + len]
}

/// Rows `o0..o0 + rows` of `w` (row layout, a tileable format and width: the caller's
/// [`QuantKernels::packs`]) times every row of `acts` into `local[r * rows + i]`, through
/// the tile bodies of `k` (not the portable body) on the panel packed here.
pub(super) fn panel(
    k: QuantKernels,
    w: &QuantMatrix<'_>,
    acts: &TileActs<'_>,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    debug_assert!(k.body() != QuantBody::Portable);
    let (format, cols, rb) = (w.format(), w.cols, w.row_bytes());
    let padded = rows.next_multiple_of(TILE_ROWS);
    let src = &w.data.bytes[o0 * rb..(o0 + rows) * rb];
    BUFFERS.with(|buffers| {
        // Never borrowed twice: a panel runs no parallel work that could start another
        // panel on this thread.
        let mut buffers = buffers.borrow_mut();
        let Buffers {
            tiled,
            plain,
            outputs,
        } = &mut *buffers;
        let src: &[u8] = if padded == rows {
            src
        } else {
            plain.clear();
            plain.extend_from_slice(src);
            plain.resize(padded * rb, 0);
            plain
        };
        let dst = aligned(tiled, padded * rb);
        // The caller checked that the format tiles at this width, and `src` and `dst` are
        // `padded` whole rows: neither can fail.
        assert!(
            tile(format, src, padded, cols, dst),
            "{format} panel [{padded}, {cols}] did not tile"
        );
        let tw = QuantSlice::tiled(dst, format, padded * cols, cols)
            .ok()
            .and_then(|q| QuantMatrix::new(q, padded, cols).ok());
        let Some(tw) = tw else {
            unreachable!("{format} tiles [{padded}, {cols}] were just made");
        };
        let out: &mut [f32] = if padded == rows {
            &mut *local
        } else {
            outputs.clear();
            outputs.resize(acts.q.n_rows * padded, 0.0);
            outputs
        };
        // SAFETY: the body's features are this CPU's (the `QuantKernels` invariant; the
        // caller never packs for the portable body); `tw` is whole tiles of `cols` of a
        // tileable format (checked by `QuantSlice::tiled` and `QuantMatrix::new` above);
        // `acts` was made for that format from rows of `cols`; rows 0..padded are the
        // whole matrix; `out` is n_rows * padded.
        unsafe {
            super::tiles_x86::panel(
                k.body() == QuantBody::Avx512Vnni,
                (k.unpacked_tiles(), k.few_row_passes(), k.q6k_row_prefetch()),
                &tw,
                acts,
                0,
                padded,
                out,
            )
        };
        if padded != rows {
            for (r, part) in local.chunks_exact_mut(rows).enumerate() {
                part.copy_from_slice(&outputs[r * padded..r * padded + rows]);
            }
        }
    });
}
