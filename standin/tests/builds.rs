//! Makes `cargo test --workspace` build the stand-in's cdylib (an integration test needs its
//! crate built, and cargo builds every crate type of it), and checks the stand-in's pure
//! parts that need no loader tricks.

#[test]
fn the_emulation_shim_is_the_one_under_kernels() {
    let shim = include_str!("../../kernels/cpu_emulation/shim.h");
    let unit =
        moec_standin::module::translation_unit("extern \"C\" __global__ void k(int n) {}", "k.cu");
    assert!(unit.starts_with(shim));
    assert!(unit.contains("#line 1 \"k.cu\""));
    assert!(unit.ends_with("MOEC_ENTRY(k)\n"));
}
