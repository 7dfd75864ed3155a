//! The one line that says which CPU kernels this process runs and why, for `moec devices`
//! and the run report. It sits apart from [`super::isa`] because it names every product's
//! bodies (`linear`, `bf16_dot`, `qmatmul::select`), which all build on `isa`.

/// One line naming the kernels this process uses and why (for `moec devices` and the run
/// report), or the refusal when `MOEC_KERNELS` asks for something this CPU cannot run.
pub fn describe() -> String {
    match super::isa::selection() {
        Ok(s) => format!(
            "CPU kernels: {} ({}); {}; {}; {}",
            s.kernels.isa().name(),
            s.reason,
            crate::math::linear::bodies(s.kernels.isa()),
            crate::math::bf16_dot::describe(s.kernels),
            crate::math::qmatmul::select::describe(s.kernels)
        ),
        Err(e) => format!("CPU kernels: refused: {e}"),
    }
}
