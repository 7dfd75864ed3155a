//! The weights image `W`, served straight from the checkpoint's memory maps.
//!
//! Takes an opened [`Checkpoint`] and the image geometry ([`ImageLayout`]); gives a
//! [`MappedImage`]: for every tensor of the packed image (embedding, each layer's segments,
//! final norm, lm_head) the bytes of the checkpoint's memory map that hold it. Nothing is
//! copied at startup and the model is not held twice: pages come from the file (or the page
//! cache) when a task first touches them, and the OS may drop them again (pageable memory).
//! A view is served only when it lies inside one tensor (ops read weights whole, through the
//! weight maps); a copy out of the image assembles any byte range tensor by tensor and
//! zero-fills the padding between segments, so its destination holds exactly the bytes of the
//! packed image. Tensors the file stores packed (gpt-oss MXFP4 experts) are served from the
//! checkpoint's one bf16 decoding of them, in place: allocated once at load, never copied
//! again, and not file pages (so not populated). The one exception to "no copy" is a tensor
//! whose stored bytes are not aligned for its dtype: that tensor alone is held as an owned,
//! aligned copy (safetensors aligns tensors in practice, so this is a fallback, not the
//! normal path).

use super::copy_pool::CopyPool;
use super::weights::{ImageError, ImageLayout, WeightTag};
use crate::model::layout::ImageBuffer;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use crate::records::load::Laps;
use crate::weights::checkpoint::Checkpoint;
use rayon::prelude::*;

/// Why bytes of the image cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageViewError {
    /// A range past the end of the image.
    #[error("weights image: bytes {start}..{end} are outside its {len} bytes")]
    OutOfBounds {
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
        /// Image size.
        len: u64,
    },
    /// A range that is not inside one tensor (it spans several, or padding).
    #[error("weights image: bytes {start}..{end} are not inside one tensor (the image is mapped tensor by tensor; copy the range to an arena to read it whole)")]
    NotOneTensor {
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
    },
}

/// Where one tensor's bytes are.
enum TensorBytes<'c> {
    /// Inside the checkpoint's memory map.
    Mapped(&'c [u8]),
    /// The checkpoint's own decoding of a tensor the file stores packed (MXFP4 experts):
    /// allocated memory, viewed in place, never copied again and not the file's pages.
    Decoded(&'c [u8]),
    /// An aligned copy (the stored bytes were misaligned for the dtype).
    Owned(ImageBuffer),
    /// A Q4_K, Q6_K, Q8_0, Q4_0 or MXFP4 matrix repacked into tiles of eight rows (`math::qmatmul::tiles`) for the
    /// CPU backend's products: the same length as the blocks it replaces, whose file
    /// pages are dropped from this process once repacked; `len` bytes at `at` of the one
    /// arena every tiled matrix shares.
    Tiled {
        /// The arena.
        arena: std::sync::Arc<memmap2::MmapMut>,
        /// Where this matrix starts in it.
        at: usize,
        /// Its bytes.
        len: usize,
    },
}

impl TensorBytes<'_> {
    fn as_bytes(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped(bytes) | TensorBytes::Decoded(bytes) => bytes,
            TensorBytes::Owned(buffer) => buffer.as_bytes(),
            TensorBytes::Tiled { arena, at, len } => &arena[*at..*at + *len],
        }
    }
}

/// One tensor of the image.
struct ImageTensor<'c> {
    /// Offset in the image.
    start: u64,
    tag: WeightTag,
    bytes: TensorBytes<'c>,
}

impl ImageTensor<'_> {
    fn end(&self) -> u64 {
        self.start + self.bytes.as_bytes().len() as u64
    }
}

/// The packed weights image as views over the checkpoint's memory maps.
pub struct MappedImage<'c> {
    /// In image order, non-overlapping.
    tensors: Vec<ImageTensor<'c>>,
    len: u64,
}

impl std::fmt::Debug for MappedImage<'_> {
    // The tensors' bytes are the whole model: never print them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedImage")
            .field("len", &self.len)
            .field("tensors", &self.tensors.len())
            .field("owned_tensors", &self.owned_tensors())
            .finish()
    }
}

/// `madvise(MADV_POPULATE_READ)` over the pages that hold `bytes`; whether it succeeded.
#[cfg(target_os = "linux")]
fn populate_read(bytes: &[u8]) -> bool {
    if bytes.is_empty() {
        return true;
    }
    let page = 4096usize;
    let start = bytes.as_ptr() as usize;
    let aligned = start - start % page;
    let len = bytes.len() + (start - aligned);
    // SAFETY: `bytes` lies inside one of the checkpoint's read-only file mappings, which
    // are page-aligned and whole pages long, so the page-aligned range [aligned, aligned +
    // len) lies inside that mapping too. MADV_POPULATE_READ only faults those pages in
    // for reading; it changes neither the mapping nor any byte of it.
    let rc = unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
    rc == 0
}

#[cfg(not(target_os = "linux"))]
fn populate_read(_bytes: &[u8]) -> bool {
    false
}

/// The alignment a typed view of a tensor needs: its dtype's, or 1 for quantised blocks
/// (read as bytes).
fn storage_align(dtype: WeightDtype, quant: Option<crate::quant::QuantFormat>) -> usize {
    match quant {
        Some(_) => 1,
        None => dtype.bytes() as usize,
    }
}

impl<'c> MappedImage<'c> {
    /// Maps every tensor of `layout` to its bytes in `checkpoint` (each checked against the
    /// layout's length and dtype); copies only misaligned tensors.
    pub fn new(checkpoint: &'c Checkpoint, layout: &ImageLayout) -> Result<Self, ImageError> {
        let head = checkpoint.head_tensors()?;
        let mut tensors = Vec::new();
        for (start, len, tag) in layout.tags() {
            let mut decoded = false;
            let (bytes, dtype, quant) = match tag {
                WeightTag::Embed => (head.embed.bytes, head.embed.dtype, head.embed.quant),
                WeightTag::FinalNorm => (
                    head.final_norm.bytes,
                    head.final_norm.dtype,
                    head.final_norm.quant,
                ),
                WeightTag::LmHead => (head.lm_head.bytes, head.lm_head.dtype, head.lm_head.quant),
                WeightTag::Layer { layer, kind } => {
                    let Some(seg) = layout.layer_of(layer).segment(kind) else {
                        continue;
                    };
                    decoded = checkpoint.segment_is_decoded(layer as usize, kind);
                    (
                        checkpoint.segment_bytes(layer as usize, seg)?,
                        seg.dtype,
                        seg.quant,
                    )
                }
                // The image's tags are the checkpoint's own; converted copies live in arenas.
                WeightTag::Converted { .. } => continue,
            };
            let align = storage_align(dtype, quant);
            if bytes.len() as u64 != len {
                return Err(ImageError::Tensor {
                    dir: checkpoint.dir().display().to_string(),
                    tag,
                    got: bytes.len() as u64,
                    expected: len,
                });
            }
            let bytes = if decoded {
                // Aligned by construction, and already in memory: not a file page to fault in.
                TensorBytes::Decoded(bytes)
            } else if (bytes.as_ptr() as usize).is_multiple_of(align) {
                TensorBytes::Mapped(bytes)
            } else {
                // Kernels view weights as typed slices, which need dtype alignment; a file
                // that stores this tensor at an odd offset gets an aligned copy of it alone.
                let mut owned = ImageBuffer::zeroed(bytes.len());
                owned.as_bytes_mut().copy_from_slice(bytes);
                TensorBytes::Owned(owned)
            };
            tensors.push(ImageTensor { start, tag, bytes });
        }
        tensors.sort_by_key(|t| t.start);
        if let Some(pair) = tensors.windows(2).find(|w| w[0].end() > w[1].start) {
            return Err(ImageError::Overlap {
                first: pair[0].tag,
                second: pair[1].tag,
            });
        }
        Ok(MappedImage {
            tensors,
            len: layout.checkpoint.total_bytes(),
        })
    }

    /// Populates the page tables of every mapped tensor (`MADV_POPULATE_READ`, reading
    /// the file into the page cache where it is not) so that the first step does not
    /// take a page fault per few KiB of weights; llama.cpp maps its weights with
    /// `MAP_POPULATE` for the same reason. Gives the bytes populated: 0 where the OS
    /// refused (before Linux 5.14, or not Linux): kernels then fault pages in as they read.
    pub fn populate(&self) -> u64 {
        let mut done = 0u64;
        for t in &self.tensors {
            let TensorBytes::Mapped(bytes) = t.bytes else {
                continue;
            };
            if populate_read(bytes) {
                done += bytes.len() as u64;
            }
        }
        done
    }

    /// Repacks the Q4_K, Q6_K, Q8_0, Q4_0 and MXFP4 matrices `tensors` (tag, format, rows, cols: what
    /// [`ImageLayout::tileable`] lists) into tiles of eight rows, each in place of its
    /// mapped bytes (the same length, so every offset of the image stays), and drops the
    /// file pages it read from this process ([`Checkpoint::release_mapped`]: only pages of
    /// the file's map; a tensor the checkpoint holds restored in memory, such as GGUF's
    /// un-permuted Q/K rows, stays as it is for its other readers). Gives the tags
    /// repacked and their bytes; a tensor that is not a mapped one of that shape is left
    /// as it is, and so is one whose bytes another tensor of the image also maps (a tied
    /// lm_head: the embedding keeps reading the file, and a tiled copy beside it would
    /// hold the matrix twice). The matrices are repacked in parallel on `pool`'s threads.
    ///
    /// The tiles share one anonymous mapping that asks for transparent huge pages
    /// (`MADV_HUGEPAGE`): a decode step streams every routed expert once, and with 4 KiB
    /// pages each page of that stream cost a TLB miss (the mid Mixtral's batch-1 decode ran
    /// about 8% faster with huge pages for its 437 MiB of tiles). Whether the OS took the
    /// advice is its own affair (`AnonHugePages` in `/proc/meminfo`); the bytes are the same.
    pub fn tile(
        &mut self,
        checkpoint: &Checkpoint,
        tensors: &[(WeightTag, QuantFormat, usize, usize)],
        pool: &CopyPool,
        laps: &mut Laps,
    ) -> Result<(Vec<WeightTag>, u64), ImageError> {
        // Which tensors, and where each goes in the arena (64-byte aligned, as the
        // bodies' loads like).
        let mut plan = Vec::new();
        let mut total = 0usize;
        for &(tag, format, rows, cols) in tensors {
            let Some(i) = self.tensors.iter().position(|t| t.tag == tag) else {
                continue;
            };
            let TensorBytes::Mapped(src) = self.tensors[i].bytes else {
                continue;
            };
            let shared = self.tensors.iter().enumerate().any(|(j, o)| {
                j != i && matches!(o.bytes, TensorBytes::Mapped(b) if b.as_ptr() == src.as_ptr())
            });
            if shared || !crate::math::qmatmul::tiles::tileable(format, rows, cols) {
                continue;
            }
            plan.push((i, format, rows, cols, src, total));
            total += src.len().next_multiple_of(64);
        }
        if plan.is_empty() {
            return Ok((Vec::new(), 0));
        }
        let mut arena = memmap2::MmapMut::map_anon(total).map_err(|e| ImageError::TileArena {
            bytes: total,
            why: e.to_string(),
        })?;
        #[cfg(target_os = "linux")]
        let advised = {
            // A hint: refused (no THP in this kernel), the tiles work the same.
            arena.advise(memmap2::Advice::HugePage).is_ok()
        };
        #[cfg(not(target_os = "linux"))]
        let advised = false;
        laps.lap("tile arena mapped").detail = Some(format!(
            "{:.2} GiB, huge pages {}",
            total as f64 / (1u64 << 30) as f64,
            if advised {
                "asked (MADV_HUGEPAGE)"
            } else {
                "not asked"
            }
        ));
        // Each matrix's own piece of the arena, in plan order (`at` grows along the plan).
        let mut pieces = Vec::with_capacity(plan.len());
        let mut rest: &mut [u8] = &mut arena[..];
        let mut offset = 0;
        for &(_, _, _, _, src, at) in &plan {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(at - offset);
            let (piece, tail) = tail.split_at_mut(src.len());
            pieces.push(piece);
            rest = tail;
            offset = at + src.len();
        }
        // In parallel over the matrices: a load is bound less by the repacking than by
        // the first touch of the arena's fresh pages and the file's reads, which both
        // proceed per thread (on a 2-core VM a serial repack of OLMoE-1B-7B's 3.9 GiB
        // spent most of its time in the kernel zeroing new huge pages).
        let tiled: Vec<(usize, usize, usize)> = pool.install(|| {
            plan.par_iter()
                .zip(pieces.into_par_iter())
                .filter_map(|(&(i, format, rows, cols, src, at), dst)| {
                    // The matrix's file pages mapped in one call rather than one fault per
                    // 64 KiB as the repacking reads them (a hint: refused, they fault in).
                    populate_read(src);
                    if !crate::math::qmatmul::tiles::tile(format, src, rows, cols, dst) {
                        return None;
                    }
                    // Dropped as soon as it is copied, so the process never holds the file's
                    // pages of every matrix beside all the tiles (a peak of twice the tiles).
                    checkpoint.release_mapped(src);
                    Some((i, src.len(), at))
                })
                .collect()
        });
        laps.lap("tiles repacked").detail = Some(format!(
            "{} matrices on {} threads",
            tiled.len(),
            pool.threads()
        ));
        let mut done = Vec::new();
        let arena = std::sync::Arc::new(arena);
        let mut bytes_done = 0u64;
        for (i, len, at) in tiled {
            bytes_done += len as u64;
            let t = &mut self.tensors[i];
            t.bytes = TensorBytes::Tiled {
                arena: arena.clone(),
                at,
                len,
            };
            done.push(t.tag);
        }
        Ok((done, bytes_done))
    }

    /// Bytes of the image (padding included).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Bytes of the image's tensors as this process holds them (mapped, decoded, owned or
    /// tiled), each distinct tensor once (a tied lm_head that is the embedding counts once):
    /// without the padding between segments and the room a layer's slot keeps for a wider
    /// format than its own (a GGUF mix's Q4_K layers in Q6_K slots), which hold no pages.
    pub fn tensor_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.tensors
            .iter()
            .map(|t| t.bytes.as_bytes())
            .filter(|b| seen.insert((b.as_ptr() as usize, b.len())))
            .map(|b| b.len() as u64)
            .sum()
    }

    /// True for an image of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tensors held as owned copies because their stored bytes were misaligned.
    pub fn owned_tensors(&self) -> usize {
        self.tensors
            .iter()
            .filter(|t| matches!(t.bytes, TensorBytes::Owned(_)))
            .count()
    }

    /// The bytes of tensor `tag`, if the image has it.
    pub fn tensor(&self, tag: WeightTag) -> Option<&[u8]> {
        self.tensors
            .iter()
            .find(|t| t.tag == tag)
            .map(|t| t.bytes.as_bytes())
    }

    fn bounds(&self, start: u64, len: u64) -> Result<u64, ImageViewError> {
        match start.checked_add(len).filter(|&end| end <= self.len) {
            Some(end) => Ok(end),
            None => Err(ImageViewError::OutOfBounds {
                start,
                end: start.saturating_add(len),
                len: self.len,
            }),
        }
    }

    /// Index of the last tensor starting at or before `at` (if any).
    fn tensor_at(&self, at: u64) -> Option<usize> {
        self.tensors
            .partition_point(|t| t.start <= at)
            .checked_sub(1)
    }

    /// `len` bytes at `start`, which must lie inside one tensor.
    pub fn view(&self, start: u64, len: u64) -> Result<&[u8], ImageViewError> {
        let end = self.bounds(start, len)?;
        if len == 0 {
            return Ok(&[]);
        }
        let inside = self.tensor_at(start).and_then(|i| {
            let tensor = &self.tensors[i];
            let from = usize::try_from(start - tensor.start).ok()?;
            let to = usize::try_from(end - tensor.start).ok()?;
            tensor.bytes.as_bytes().get(from..to)
        });
        inside.ok_or(ImageViewError::NotOneTensor { start, end })
    }

    /// Image bytes `[start, start + len)` as consecutive pieces, tensor by tensor: each
    /// (offset from `start`, bytes of one tensor) or (offset, length) of padding between
    /// tensors, which reads as zeros. What a copy that reads the tensors' own memory
    /// (a device copy from a registered checkpoint) needs instead of an assembled buffer.
    pub fn pieces(&self, start: u64, len: u64) -> Result<Vec<ImagePiece<'_>>, ImageViewError> {
        let end = self.bounds(start, len)?;
        let mut out = Vec::new();
        let mut filled = start;
        let first = self.tensor_at(start).unwrap_or(0);
        for tensor in self.tensors[first..].iter().take_while(|t| t.start < end) {
            let tensor_end = tensor.end();
            if tensor_end <= filled {
                continue;
            }
            let lo = tensor.start.max(filled);
            let hi = tensor_end.min(end);
            if lo > filled {
                out.push(ImagePiece::Zeros {
                    offset: filled - start,
                    len: lo - filled,
                });
            }
            let bytes = tensor.bytes.as_bytes();
            out.push(ImagePiece::Bytes {
                offset: lo - start,
                bytes: &bytes[(lo - tensor.start) as usize..(hi - tensor.start) as usize],
            });
            filled = hi;
        }
        if end > filled {
            out.push(ImagePiece::Zeros {
                offset: filled - start,
                len: end - filled,
            });
        }
        Ok(out)
    }

    /// Copies image bytes `[start, start + dst.len())` into `dst`, tensor by tensor from the
    /// maps, with zeros for the padding between tensors.
    pub fn copy_to(&self, start: u64, dst: &mut [u8]) -> Result<(), ImageViewError> {
        for piece in self.pieces(start, dst.len() as u64)? {
            // Pieces cover [start, start + dst.len()) in order, so every range fits `dst`.
            match piece {
                ImagePiece::Bytes { offset, bytes } => {
                    let at = offset as usize;
                    dst[at..at + bytes.len()].copy_from_slice(bytes);
                }
                ImagePiece::Zeros { offset, len } => {
                    dst[offset as usize..(offset + len) as usize].fill(0);
                }
            }
        }
        Ok(())
    }

    /// Where every tensor's bytes are in this process's memory (address, length), in image
    /// order: what a device backend registers with its driver so copies read the weights
    /// where they are.
    pub fn host_ranges(&self) -> Vec<(usize, usize)> {
        self.tensors
            .iter()
            .map(|t| {
                let bytes = t.bytes.as_bytes();
                (bytes.as_ptr() as usize, bytes.len())
            })
            .filter(|&(_, len)| len > 0)
            .collect()
    }
}

/// A consecutive piece of a range of the image ([`MappedImage::pieces`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImagePiece<'a> {
    /// Bytes of one tensor, where they are in memory.
    Bytes {
        /// Offset from the range's start.
        offset: u64,
        /// The tensor's bytes in the range.
        bytes: &'a [u8],
    },
    /// Padding between tensors: zeros.
    Zeros {
        /// Offset from the range's start.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::CheckpointLayout;
    use crate::math::tensor::TypedSlice;
    use crate::math::views::QkvWeights;
    use crate::model::card::ModelCard;
    use crate::model::segment::SegmentKind;
    use crate::runtime::host::weights::image_layout;
    use crate::weights::synth::{write_checkpoint, SynthOptions};
    use std::path::Path;

    fn synth(card_name: &str, dir: &Path) -> Checkpoint {
        synth_card(&ModelCard::load(card_name).unwrap(), dir)
    }

    fn synth_card(card: &ModelCard, dir: &Path) -> Checkpoint {
        write_checkpoint(
            card,
            dir,
            &SynthOptions {
                seed: 3,
                dtype: card.dtype,
                max_shard_bytes: u64::MAX,
            },
        )
        .unwrap();
        Checkpoint::open(dir).unwrap()
    }

    fn layout_of(checkpoint: &Checkpoint) -> ImageLayout {
        image_layout(checkpoint, CheckpointLayout::new(checkpoint.card())).unwrap()
    }

    fn raw(slice: TypedSlice<'_>) -> &[u8] {
        match slice {
            TypedSlice::Bf16(s) => bytemuck::cast_slice(s),
            TypedSlice::F16(s) => bytemuck::cast_slice(s),
            TypedSlice::F32(s) => bytemuck::cast_slice(s),
            TypedSlice::Quant(q) => q.bytes,
        }
    }

    /// The bytes of segment `kind` of `layer`, through the checkpoint's typed zero-copy
    /// views (a different path from `Checkpoint::segment_bytes`).
    fn typed_segment(checkpoint: &Checkpoint, layer: usize, kind: SegmentKind) -> &[u8] {
        let w = checkpoint.layer_weights(layer).unwrap();
        let data = match (kind, &w.dense.qkv) {
            (SegmentKind::AttnNorm, _) => w.dense.attn_norm,
            (SegmentKind::QProj, QkvWeights::Separate { q, .. }) => q.data,
            (SegmentKind::KProj, QkvWeights::Separate { k, .. }) => k.data,
            (SegmentKind::VProj, QkvWeights::Separate { v, .. }) => v.data,
            (SegmentKind::QkvProj, QkvWeights::Fused(qkv)) => qkv.data,
            (SegmentKind::OProj, _) => w.dense.o_proj.data,
            (SegmentKind::FfnNorm, _) => w.dense.ffn_norm,
            (SegmentKind::Router, _) => w.dense.router.data,
            (SegmentKind::ExpertGate(e), _) => w.experts[e].gate.data,
            (SegmentKind::ExpertUp(e), _) => w.experts[e].up.data,
            (SegmentKind::ExpertDown(e), _) => w.experts[e].down.data,
            other => panic!("segment {other:?} does not belong to this family"),
        };
        raw(data)
    }

    /// The packed image exactly as the runtime used to build it before the image was mapped
    /// (`write_image`): a zeroed buffer with the embedding, each layer's packed image
    /// (`Checkpoint::copy_layer_image`), the final norm and the lm_head copied in.
    fn reference_image(checkpoint: &Checkpoint, layout: &ImageLayout) -> Vec<u8> {
        let c = &layout.checkpoint;
        let mut dst = vec![0u8; c.total_bytes() as usize];
        let weights = checkpoint.model_weights().unwrap();
        let embed = raw(weights.embed.data);
        dst[..embed.len()].copy_from_slice(embed);
        for layer in 0..c.layers {
            let start = c.layer_offset(layer) as usize;
            let end = start + c.layer_bytes_of(layer) as usize;
            let image = layout.layer_of(layer as u32);
            checkpoint
                .copy_layer_image(layer as usize, image, &mut dst[start..end])
                .unwrap();
        }
        let head = c.head_offset() as usize;
        let norm = raw(weights.final_norm);
        dst[head..head + norm.len()].copy_from_slice(norm);
        let lm = raw(weights.lm_head.data);
        dst[head + norm.len()..head + norm.len() + lm.len()].copy_from_slice(lm);
        dst
    }

    /// Address ranges of this process's mappings of `file`.
    fn mappings_of(file: &Path) -> Vec<(usize, usize)> {
        let file = file.canonicalize().unwrap();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .filter(|line| line.ends_with(file.to_str().unwrap()))
            .map(|line| {
                let range = line.split_whitespace().next().unwrap();
                let (lo, hi) = range.split_once('-').unwrap();
                (
                    usize::from_str_radix(lo, 16).unwrap(),
                    usize::from_str_radix(hi, 16).unwrap(),
                )
            })
            .collect()
    }

    /// Deterministic pseudo-random numbers (xorshift) for the ranges.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// Copies of the whole image, of ranges around every tensor boundary and of random
    /// ranges (across several tensors and their padding) equal the reference bytes.
    fn assert_copies_match(image: &MappedImage<'_>, reference: &[u8], layout: &ImageLayout) {
        let total = reference.len() as u64;
        assert_eq!(image.len(), total);
        let mut ranges = vec![(0, total)];
        for (start, len, _) in layout.tags() {
            let end = start + len;
            ranges.push((start.saturating_sub(3), (end + 5).min(total)));
            ranges.push((start + len / 2, (end + 64).min(total)));
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..300 {
            let start = next(&mut state) % total;
            let len = next(&mut state) % (1 << (next(&mut state) % 22));
            ranges.push((start, (start + len).min(total)));
        }
        let mut spanning = 0;
        for (start, end) in ranges {
            let mut dst = vec![0xA5u8; (end - start) as usize];
            image.copy_to(start, &mut dst).unwrap();
            assert!(
                dst == reference[start as usize..end as usize],
                "bytes {start}..{end} differ from the copied image"
            );
            if image.view(start, end - start).is_err() {
                spanning += 1;
            }
        }
        assert!(spanning > 100, "too few ranges spanned several tensors");
    }

    fn check_card(card: &ModelCard) {
        let dir = tempfile::tempdir().unwrap();
        let ck_dir = dir.path().join("ck");
        let checkpoint = synth_card(card, &ck_dir);
        let layout = layout_of(&checkpoint);
        let reference = reference_image(&checkpoint, &layout);
        let image = MappedImage::new(&checkpoint, &layout).unwrap();
        assert_eq!(image.owned_tensors(), 0);
        assert_copies_match(&image, &reference, &layout);
        let maps = mappings_of(&ck_dir.join("model.safetensors"));
        assert!(!maps.is_empty());
        for (start, len, tag) in layout.tags() {
            let view = image.view(start, len).unwrap();
            assert_eq!(view, &reference[start as usize..(start + len) as usize]);
            let at = view.as_ptr() as usize;
            assert!(
                maps.iter()
                    .any(|&(lo, hi)| lo <= at && at + view.len() <= hi),
                "{tag} is not viewed inside the checkpoint's mapping"
            );
            if let WeightTag::Layer { layer, kind } = tag {
                let typed = typed_segment(&checkpoint, layer as usize, kind);
                assert_eq!(view.as_ptr(), typed.as_ptr(), "{tag}");
            }
            // Inside one tensor: served; one byte past it: refused, never a panic.
            assert_eq!(image.view(start + 1, len - 1).unwrap(), &view[1..]);
            if start + len < image.len() {
                assert!(matches!(
                    image.view(start, len + 1),
                    Err(ImageViewError::NotOneTensor { .. })
                ));
            }
        }
        assert!(matches!(
            image.view(image.len() - 1, 2),
            Err(ImageViewError::OutOfBounds { .. })
        ));
        assert!(image.copy_to(u64::MAX, &mut [0u8; 4]).is_err());
    }

    #[test]
    fn mixtral_image_is_the_mapped_checkpoint() {
        check_card(&ModelCard::load("mixtral-tiny").unwrap());
    }

    #[test]
    fn dbrx_image_is_the_mapped_checkpoint() {
        // DBRX experts are row ranges of fused tensors.
        check_card(&ModelCard::load("dbrx-tiny").unwrap());
    }

    #[test]
    fn padding_between_tensors_is_zero_filled() {
        // Widths whose tensors are not multiples of the 64-byte segment alignment, so the
        // packed image has padding after norms, projections and experts.
        let mut card = ModelCard::load("mixtral-tiny").unwrap();
        card.name = "mixtral-odd".into();
        (
            card.hidden,
            card.ffn,
            card.heads,
            card.kv_heads,
            card.head_dim,
        ) = (36, 50, 3, 1, 12);
        card.layers = 2;
        let layout = CheckpointLayout::new(&card);
        let padded = layout.moe_layer_bytes()
            - (card.hidden * 2 + (card.heads + 2 * card.kv_heads) * card.head_dim * card.hidden)
                * 2
            - (card.heads * card.head_dim * card.hidden + card.experts * card.hidden) * 2
            - card.experts * 3 * card.ffn * card.hidden * 2;
        assert!(padded > 0, "the odd card's layers have no padding");
        check_card(&card);
    }

    /// Rewrites `dir/model.safetensors` with a one-byte tensor stored first (so every other
    /// tensor sits at an odd offset) and without `lm_head.weight`, and ties the embeddings.
    fn misalign_and_tie(dir: &Path) {
        let path = dir.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors = file.tensors();
        tensors.retain(|(name, _)| name != "lm_head.weight");
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let mut header = serde_json::Map::new();
        header.insert(
            "aaa_pad".into(),
            serde_json::json!({"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}),
        );
        let mut data = vec![0u8];
        for (name, view) in &tensors {
            let start = data.len();
            data.extend_from_slice(view.data());
            header.insert(
                name.clone(),
                serde_json::json!({
                    "dtype": format!("{:?}", view.dtype()),
                    "shape": view.shape(),
                    "data_offsets": [start, data.len()],
                }),
            );
        }
        let mut header = serde_json::Value::Object(header).to_string().into_bytes();
        // Data starts 8-aligned in the file, so the tensors after the pad byte are odd.
        header.resize(header.len().div_ceil(8) * 8, b' ');
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&header);
        out.extend_from_slice(&data);
        std::fs::write(&path, out).unwrap();
        let config_path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        config["tie_word_embeddings"] = serde_json::Value::Bool(true);
        std::fs::write(&config_path, config.to_string()).unwrap();
    }

    #[test]
    fn misaligned_tensors_are_copied_aligned_and_tied_head_is_the_embedding() {
        let dir = tempfile::tempdir().unwrap();
        let (aligned_dir, odd_dir) = (dir.path().join("aligned"), dir.path().join("odd"));
        let aligned = synth("mixtral-tiny", &aligned_dir);
        let layout = layout_of(&aligned);
        let mut reference = reference_image(&aligned, &layout);
        let embed = reference[..layout.checkpoint.embed_bytes as usize].to_vec();
        let lm_start = (layout.checkpoint.head_offset() + layout.final_norm_bytes) as usize;
        reference[lm_start..lm_start + embed.len()].copy_from_slice(&embed);

        synth("mixtral-tiny", &odd_dir);
        misalign_and_tie(&odd_dir);
        let odd = Checkpoint::open(&odd_dir).unwrap();
        // The typed views (the oracle's) and the image both copy misaligned tensors aligned.
        assert!(odd.model_weights().is_ok());
        let odd_layout = layout_of(&odd);
        let image = MappedImage::new(&odd, &odd_layout).unwrap();
        assert_eq!(image.owned_tensors(), odd_layout.tags().len());
        assert_copies_match(&image, &reference, &odd_layout);
        for (start, len, tag) in odd_layout.tags() {
            let view = image.view(start, len).unwrap();
            assert_eq!(view.as_ptr() as usize % 2, 0, "{tag} is misaligned");
            assert_eq!(view, &reference[start as usize..(start + len) as usize]);
        }
    }
}
