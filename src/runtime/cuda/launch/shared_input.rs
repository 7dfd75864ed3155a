//! Products that take one input for several weights and the integer products: q|k|v or a
//! shared expert's gate|up in one launch ([`StreamCx::linear_shared`], with its input's
//! RMSNorm folded in by [`RmsNormArg`]), and projections on activation rows quantised once per
//! input ([`StreamCx::quantize_q8`], [`Q8Act`], [`StreamCx::linear_q8`]) or rounded to the
//! activation format for a cuBLAS GEMM of decoded weights.

use super::*;

/// An RMSNorm a kernel applies to its input rows itself (`linear_gemv3`): the norm
/// weight's address and kernel code, epsilon, and the rows' width (the kernel takes
/// rms_norm's block size for it, [`row_block`], so its values are that launch's).
#[derive(Debug, Clone, Copy)]
pub struct RmsNormArg {
    /// Device address of the weight.
    pub weight: u64,
    /// Its kernel dtype code (`kernels/prelude.cuh`).
    pub code: i32,
    /// Epsilon.
    pub eps: f32,
    /// Values per row.
    pub width: usize,
}

/// Activation rows quantised for the integer products ([`StreamCx::quantize_q8`]): the
/// CPU's `Q8Rows` codes and scales in device scratch.
#[derive(Debug, Clone, Copy)]
pub struct Q8Act {
    /// `[rows, cols]` int8 codes.
    pub codes: u64,
    /// `[rows, cols / block]` f32 scales.
    pub scales: u64,
    /// The activation format (Q8_K or Q8_0).
    pub format: ActFormat,
    /// Rows.
    pub rows: usize,
    /// Values per row.
    pub cols: usize,
}

/// The activation format of an [`int_product`] weight format (ggml's `vec_dot_type`: Q8_K
/// for the K-quants, Q8_0 otherwise).
pub fn act_format(format: Option<QuantFormat>) -> ActFormat {
    format.map_or(ActFormat::Q8_0, ActFormat::for_weights)
}

impl StreamCx<'_> {
    /// `rows` rows of `cols` values at `x` (rows `x_row` floats apart) quantised once to
    /// `format` (`q8_quantize`, kernels/activations_q8.cu) for any number of integer
    /// products that share the input (q, k and v; gate and up). `live` (0: none): a device
    /// `int` counting the rows that hold values; rows past it are neither read nor written.
    pub fn quantize_q8(
        &self,
        x: u64,
        x_row: usize,
        rows: usize,
        cols: usize,
        format: ActFormat,
        live: u64,
    ) -> Result<Q8Act, LaunchError> {
        let block = format.block_elems();
        let codes = self.scratch(rows * cols)?;
        let scales = self.scratch(rows * cols / block * 4)?;
        let kind = q8_kind(format);
        // One warp per block of values.
        self.launch_1d(
            "q8_quantize",
            rows * cols / block * 32,
            &[
                Arg::Ptr(x),
                Arg::I64(x_row as i64),
                Arg::I32(int("cols", cols)?),
                Arg::I64(rows as i64),
                Arg::Ptr(live),
                Arg::Ptr(codes.ptr()),
                Arg::Ptr(scales.ptr()),
                Arg::I32(kind),
            ],
        )?;
        Ok(Q8Act {
            codes: codes.ptr(),
            scales: scales.ptr(),
            format,
            rows,
            cols,
        })
    }

    /// `y[a.rows, out] (=|+=) a · Wᵀ` for an [`int_product`] `w` over quantised rows `a`
    /// (at most [`GEMV_MAX_ROWS`]): one `linear_gemv_q8` launch, a warp per output (a
    /// quarter warp per output past [`GEMV_MAX_OUT`] outputs: a vocabulary head).
    pub fn linear_q8(
        &self,
        a: &Q8Act,
        w: &DevMatrix,
        y: u64,
        ldy: usize,
        accumulate: bool,
    ) -> Result<(), LaunchError> {
        let m = w.out_dim();
        let group = if m > GEMV_MAX_OUT { 8 } else { 32 };
        let per_block = 32 * GEMV_WARPS / group;
        self.launch(
            q8_entry("linear_gemv_q8", a.rows),
            (int("out", m.div_ceil(per_block))? as u32, 1, 1),
            (32 * GEMV_WARPS) as u32,
            0,
            &[
                Arg::Ptr(a.codes),
                Arg::Ptr(a.scales),
                Arg::Ptr(w.ptr),
                Arg::Ptr(y),
                Arg::I32(int("n", a.rows)?),
                Arg::I32(int("in", a.cols)?),
                Arg::I32(int("out", m)?),
                Arg::I32(w.code()),
                Arg::I32(int("ldy", ldy)?),
                Arg::I32(i32::from(accumulate)),
                Arg::I32(group as i32),
            ],
        )
    }

    /// `y[1, out] (=|+=) x · Wᵀ` for an [`int_product`] `w` over one row of `x` that the
    /// launch quantises itself (`linear_gemv_q8_x1`, see [`q8_folds`]); `x_row` the row's
    /// stride (unused for one row but passed as the kernel's). Outputs per warp as
    /// [`StreamCx::linear_q8`].
    pub fn linear_q8_folded(
        &self,
        x: u64,
        x_row: usize,
        w: &DevMatrix,
        y: u64,
        ldy: usize,
        accumulate: bool,
    ) -> Result<(), LaunchError> {
        let m = w.out_dim();
        let format = act_format(w.quant);
        let group = if m > GEMV_MAX_OUT { 8 } else { 32 };
        let per_block = 32 * GEMV_WARPS / group;
        self.launch(
            "linear_gemv_q8_x1",
            (int("out", m.div_ceil(per_block))? as u32, 1, 1),
            (32 * GEMV_WARPS) as u32,
            q8_fold_shared(w.in_dim(), format) as u32,
            &[
                Arg::Ptr(x),
                Arg::I64(x_row as i64),
                Arg::I32(q8_kind(format)),
                Arg::Ptr(w.ptr),
                Arg::Ptr(y),
                Arg::I32(1),
                Arg::I32(int("in", w.in_dim())?),
                Arg::I32(int("out", m)?),
                Arg::I32(w.code()),
                Arg::I32(int("ldy", ldy)?),
                Arg::I32(i32::from(accumulate)),
                Arg::I32(group as i32),
            ],
        )
    }

    /// Several [`StreamCx::linear`] products of the same `n` rows of `x` (q, k and v of
    /// one input; gate and up): two or three that can share a launch run as one
    /// (`linear_gemv3` / `linear_gemv3_q8`, see `linear_fused`); otherwise the integer
    /// products among them quantise `x` once per activation format and share it, and the
    /// others run as [`StreamCx::linear`] does.
    pub fn linear_shared(
        &self,
        x: u64,
        n: usize,
        products: &[(&DevMatrix, u64, usize, bool)],
    ) -> Result<(), LaunchError> {
        if self.linear_fused(x, n, products, None)? {
            return Ok(());
        }
        let mut quantised: Vec<Q8Act> = Vec::new();
        for &(w, y, ldy, accumulate) in products {
            if n == 0 || linear_kernel(w, n) != "q8_quantize + linear_gemv_q8" {
                self.linear(x, n, w, y, ldy, accumulate)?;
                continue;
            }
            let (k, format) = (w.in_dim(), act_format(w.quant));
            if q8_folds(n, k, format) {
                // One row: each product quantises it itself.
                self.linear(x, n, w, y, ldy, accumulate)?;
                continue;
            }
            let a = match quantised.iter().find(|a| a.format == format && a.cols == k) {
                Some(a) => *a,
                None => {
                    let a = self.quantize_q8(x, k, n, k, format, 0)?;
                    quantised.push(a);
                    a
                }
            };
            self.linear_q8(&a, w, y, ldy, accumulate)?;
        }
        Ok(())
    }

    /// [`StreamCx::linear_shared`] of `x` RMSNorm'd with `norm` first, in one launch
    /// (`linear_gemv3` normalising its inputs as it reads them: rms_norm's values, no
    /// normalised copy) when the products can share a float launch; gives false, having
    /// launched nothing, otherwise (the caller normalises into scratch and calls
    /// [`StreamCx::linear_shared`]).
    pub fn linear_shared_rms_normed(
        &self,
        x: u64,
        n: usize,
        norm: RmsNormArg,
        products: &[(&DevMatrix, u64, usize, bool)],
    ) -> Result<bool, LaunchError> {
        self.linear_fused(x, n, products, Some(norm))
    }

    /// Two or three few-row products of `x` in one launch (`linear_gemv3`, or
    /// `linear_gemv3_q8` after one `q8_quantize`) when they can share it: all float weights
    /// on `linear_gemv`, or all integer products of one activation format; the same input
    /// width and row stride, none accumulating, each output a whole number of floats after
    /// the first's (q | k | v of one row). `norm`: `x` RMSNorm'd inside the launch (float
    /// weights only). Gives false, having launched nothing, otherwise.
    fn linear_fused(
        &self,
        x: u64,
        n: usize,
        products: &[(&DevMatrix, u64, usize, bool)],
        norm: Option<RmsNormArg>,
    ) -> Result<bool, LaunchError> {
        let Some(&(first, y0, ldy, _)) = products.first() else {
            return Ok(false);
        };
        if !(2..=3).contains(&products.len()) || n == 0 || n > GEMV_MAX_ROWS {
            return Ok(false);
        }
        let kernel = linear_kernel(first, n);
        let integer = kernel == "q8_quantize + linear_gemv_q8";
        let float = kernel == "linear_gemv" && first.quant.is_none();
        if norm.is_some() && !float {
            return Ok(false);
        }
        let k = first.in_dim();
        let mut cols = Vec::with_capacity(3);
        for &(w, y, l, accumulate) in products {
            let same_kernel = linear_kernel(w, n) == kernel
                && ((float && w.quant.is_none())
                    || (integer && act_format(w.quant) == act_format(first.quant)));
            let col = y.checked_sub(y0).filter(|d| d % 4 == 0).map(|d| d / 4);
            let col = col.and_then(|c| i32::try_from(c).ok());
            match col {
                Some(c) if same_kernel && !accumulate && l == ldy && w.in_dim() == k => {
                    cols.push(c)
                }
                _ => return Ok(false),
            }
        }
        // Absent third product: no outputs (its pointer never read).
        let seg = |i: usize| products.get(i).map_or((first, 0), |p| (p.0, p.0.out_dim()));
        let (s0, s1, s2) = (seg(0), seg(1), seg(2));
        let total = s0.1 + s1.1 + s2.1;
        let grid = (int("out", total.div_ceil(GEMV_WARPS))? as u32, 1, 1);
        let mut args = Vec::with_capacity(18);
        let mut shared = 0u32;
        let format = act_format(first.quant);
        let entry = if integer && q8_folds(n, k, format) {
            // One row, quantised inside the launch.
            args.extend([Arg::Ptr(x), Arg::I64(k as i64), Arg::I32(q8_kind(format))]);
            shared = q8_fold_shared(k, format) as u32;
            "linear_gemv3_q8_x1"
        } else if integer {
            let a = self.quantize_q8(x, k, n, k, format, 0)?;
            args.extend([Arg::Ptr(a.codes), Arg::Ptr(a.scales)]);
            q8_entry("linear_gemv3_q8", n)
        } else {
            args.push(Arg::Ptr(x));
            // One row of bf16/f16 weights: the warp form (each warp its own norm scale,
            // its weights loaded before it), unless MOEC_FLOAT_KERNELS=block.
            let one_row = products
                .iter()
                .all(|p| one_row_half(n, p.0.quant, p.0.code(), &[p.0.ptr, x], k))
                && norm.is_none_or(|m| (0..=2).contains(&m.code));
            // 2-16 rows of bf16/f16 weights: the staged row forms unless
            // MOEC_FLOAT_KERNELS=generic-rows or block.
            let mut staged = norm.is_none_or(|m| (0..=2).contains(&m.code));
            let mut suffix = None;
            for p in products {
                let s = staged_rows(n, p.0.quant, p.0.code(), &[p.0.ptr, x], k)
                    .map_err(LaunchError::Setting)?;
                staged &= s.is_some();
                suffix = suffix.or(s);
            }
            if one_row && warp_float_kernels().map_err(LaunchError::Setting)? {
                "linear_gemv3_1"
            } else if staged && suffix == Some("_r4") {
                "linear_gemv3_r4"
            } else if staged && suffix.is_some() {
                "linear_gemv3_r16"
            } else {
                "linear_gemv3"
            }
        };
        args.extend([
            Arg::Ptr(s0.0.ptr),
            Arg::Ptr(s1.0.ptr),
            Arg::Ptr(s2.0.ptr),
            Arg::I32(int("out", s0.1)?),
            Arg::I32(int("out", s1.1)?),
            Arg::I32(int("out", s2.1)?),
            Arg::I32(s0.0.code()),
            Arg::I32(s1.0.code()),
            Arg::I32(s2.0.code()),
            Arg::Ptr(y0),
            Arg::I32(int("n", n)?),
            Arg::I32(int("in", k)?),
            Arg::I32(int("ldy", ldy)?),
            Arg::I32(cols.get(1).copied().unwrap_or(0)),
            Arg::I32(cols.get(2).copied().unwrap_or(0)),
        ]);
        if !integer {
            let norm = norm.unwrap_or(RmsNormArg {
                weight: 0,
                code: 0,
                eps: 0.0,
                width: k,
            });
            args.extend([
                Arg::Ptr(norm.weight),
                Arg::I32(norm.code),
                Arg::F32(norm.eps),
                Arg::I32(row_block(norm.width) as i32),
            ]);
        }
        self.launch(entry, grid, (32 * GEMV_WARPS) as u32, shared, &args)?;
        Ok(true)
    }

    /// The activations a product with `weights` multiplies: `x` (`n` rows of `k` values)
    /// itself for float weights or when the process decodes quantised weights to f32
    /// (`MOEC_QUANT_PRODUCT=decoded`), else a scratch copy rounded through the 8-bit format
    /// the CPU's default product quantises them to (`q8_roundtrip`, kernels/activations_q8.cu:
    /// Q8_K for K-quant weights, Q8_0 blocks otherwise), so both backends multiply the same
    /// values. `k` is whole blocks of that format: quantised rows are whole weight blocks.
    /// `live` (0: none): a device `int` counting the rows that hold values (grouped expert
    /// positions past the routed ones are never written); rows past it are neither read
    /// nor written, and the product never reads them.
    pub fn quant_activations(
        &self,
        x: u64,
        n: usize,
        k: usize,
        weights: Option<QuantFormat>,
        live: u64,
    ) -> Result<u64, LaunchError> {
        Ok(self
            .rounded_activations((x, k, 0), n, 1, k, weights, live)?
            .map_or(x, |(ptr, _, _)| ptr))
    }

    /// [`StreamCx::quant_activations`] of per-head slices: `x` = (pointer, row stride, head
    /// stride) in floats, `heads` slices of `width` values per row. Gives the rounded copy
    /// packed `[n, heads, width]` as (pointer, row stride, head stride), or `None` when the
    /// product takes `x` as it is.
    pub fn quant_head_activations(
        &self,
        x: (u64, usize, usize),
        n: usize,
        heads: usize,
        width: usize,
        weights: Option<QuantFormat>,
    ) -> Result<Option<(u64, usize, usize)>, LaunchError> {
        self.rounded_activations(x, n, heads, width, weights, 0)
    }

    /// [`StreamCx::quant_head_activations`] with a device count of live rows (see
    /// [`StreamCx::quant_activations`]).
    fn rounded_activations(
        &self,
        x: (u64, usize, usize),
        n: usize,
        heads: usize,
        width: usize,
        weights: Option<QuantFormat>,
        live: u64,
    ) -> Result<Option<(u64, usize, usize)>, LaunchError> {
        let Some(format) = weights else {
            return Ok(None);
        };
        if n == 0 || heads == 0 || Kernels::process().decodes_quant() {
            return Ok(None);
        }
        let act = ActFormat::for_weights(format);
        let elems = n * heads * width;
        let blocks = elems / act.block_elems();
        let rounded = self.scratch(elems * 4)?;
        // Q8_1 (Q4_1 weights) has Q8_0's codes and scale; its f16 block sum only regroups
        // the weights' minimum term, which the device sums from the rounded values.
        let kind = match act {
            ActFormat::Q8K => 0,
            _ => 1,
        };
        // One warp per block of values.
        self.launch_1d(
            "q8_roundtrip",
            blocks * 32,
            &[
                Arg::Ptr(x.0),
                Arg::I64(x.1 as i64),
                Arg::I64(x.2 as i64),
                Arg::I32(int("heads", heads)?),
                Arg::I32(int("width", width)?),
                Arg::Ptr(rounded.ptr()),
                Arg::I64(blocks as i64),
                Arg::I32(kind),
                Arg::Ptr(live),
            ],
        )?;
        Ok(Some((rounded.ptr(), heads * width, width)))
    }

    /// [`StreamCx::linear`] of a quantised `w` over more rows than the GEMV takes: the
    /// blocks decoded to f32 into this task's scratch (`dequant_f32`, the CPU's decoded
    /// bits), then one `cublasSgemm`. Chosen over decoding tiles into shared memory (SIMT
    /// f32 FMAs, about a tenth of the GEMM's rate on an H200 at prefill shapes, see
    /// `GROUPED_MAX_ENTRIES` in `ops`) and over a bf16 copy for the bf16 GEMM (which would
    /// round the decoded weights to 8 bits of mantissa, where the CPU computes with their
    /// f32 values): the scratch is `out x in` floats for one matrix, reused by the
    /// stream's next task.
    pub(super) fn quant_gemm(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        ldy: usize,
        accumulate: bool,
    ) -> Result<(), LaunchError> {
        let (m, k) = (w.out_dim(), w.in_dim());
        let elems = w.rows * w.cols;
        let decoded = self.scratch(elems * 4)?;
        self.launch_1d(
            "dequant_f32",
            elems / 8,
            &[
                Arg::Ptr(w.ptr),
                Arg::Ptr(decoded.ptr()),
                Arg::I64((elems / 8) as i64),
                Arg::I32(w.code()),
            ],
        )?;
        // A is m x k f32 stored [out, in] (quantised matrices always are), B is k x n f32
        // (x rows), C is y with its row stride.
        self.issue(Command::Gemm(Gemm {
            bf16: false,
            transa: true,
            m: int("out", m)?,
            n: int("n", n)?,
            k: int("in", k)?,
            alpha: 1.0,
            beta: if accumulate { 1.0 } else { 0.0 },
            a: (decoded.ptr(), int("lda", w.cols)?),
            b: (x, int("in", k)?),
            c: (y, int("ldy", ldy)?),
        }))
    }
}
