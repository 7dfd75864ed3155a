//! Format copies of the experts on the CUDA path (issue 45): `moe_count_experts`
//! (kernels/moe_grouped.cu), the device's count of expert computations for the run
//! report's `lossy substitute:` line, through cudarc on the stand-in driver against the
//! CPU backend's count of the same grouping.

use crate::standin::{
    cfg, in_standin_child, kernel_entry, load_kernels, run_under_standin, standin_context, Rng,
};
use cudarc::driver::PushKernelArg;
use moec::model::vocab::{ExpertGroups, Routing};
use moec::runtime::cuda::detect::detect;

/// After `moe_group` groups a route by the member experts, `moe_count_experts` adds to
/// counts[0] the members that got entries and, only when the group is substituted, the
/// same to counts[1]: what `ExpertGroups::of(members).count()` gives on the CPU (the CPU
/// backend counts one computation per such expert), added up over the calls as a stream's
/// pair is over a run (starting from (5, 2), so a kernel that overwrote would show).
/// Random routes of distinct experts per token at odd sizes: 1 to 37 tokens, top-1 to
/// top-3, 3 to 61 experts, so one expert has three tiles of 16 (37 tokens at top-3 over 3
/// experts) and most of 61 have none; member sets of every expert, a random half, one
/// expert and none.
#[test]
fn expert_counts_on_the_device_match_the_cpu_grouping() {
    const NAME: &str = "standin_format_copies::expert_counts_on_the_device_match_the_cpu_grouping";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let group = kernel_entry(&modules, "moe_group");
    let count = kernel_entry(&modules, "moe_count_experts");
    let mut rng = Rng(0x5eed_f00d_1234_0045);
    let mut pick = |below: usize| {
        let u = (rng.next_f32() + 1.0) * 0.5;
        ((u * below as f32) as usize).min(below - 1)
    };
    let mut counts = stream.clone_htod([5u64, 2u64].as_slice()).expect("htod");
    let mut want = [5u64, 2u64];
    for (n, k, e) in [
        (1usize, 1usize, 3usize),
        (37, 3, 3),
        (5, 2, 61),
        (13, 3, 17),
        (29, 2, 8),
    ] {
        let mut experts: Vec<u32> = Vec::with_capacity(n * k);
        for _ in 0..n {
            let mut row: Vec<u32> = Vec::with_capacity(k);
            while row.len() < k {
                let x = pick(e) as u32;
                if !row.contains(&x) {
                    row.push(x);
                }
            }
            experts.extend(row);
        }
        let weights = vec![0.5f32; n * k];
        let route: Vec<u32> = experts
            .iter()
            .zip(&weights)
            .flat_map(|(&x, w)| [x, w.to_bits()])
            .collect();
        let routing = Routing {
            top_k: k,
            experts,
            weights,
        };
        let groups = ExpertGroups::new(&routing, e);
        let route_dev = stream.clone_htod(&route).expect("htod");
        let single = pick(e);
        let sets: [Vec<bool>; 4] = [
            vec![true; e],
            (0..e).map(|_| pick(2) == 1).collect(),
            (0..e).map(|x| x == single).collect(),
            vec![false; e],
        ];
        for (call, set) in sets.iter().enumerate() {
            let members: Vec<u32> = (0..e as u32).filter(|&x| set[x as usize]).collect();
            // moe_group reads membership from a table of addresses (0: not a member).
            let table: Vec<u64> = set.iter().map(|&m| u64::from(m)).collect();
            let table_dev = stream.clone_htod(&table).expect("htod");
            let entries = n * k;
            let mut perm_row = stream.alloc_zeros::<u32>(entries).expect("alloc");
            let mut perm_slot = stream.alloc_zeros::<u32>(entries).expect("alloc");
            let mut perm_weight = stream.alloc_zeros::<f32>(entries).expect("alloc");
            let mut tiles = stream
                .alloc_zeros::<i32>(2 + 3 * (entries + e))
                .expect("alloc");
            let (entries_i, k_i, e_i) = (entries as i64, k as i32, e as i32);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&group)
                    .arg(&route_dev)
                    .arg(&table_dev)
                    .arg(&mut perm_row)
                    .arg(&mut perm_slot)
                    .arg(&mut perm_weight)
                    .arg(&mut tiles)
                    .arg(&entries_i)
                    .arg(&k_i)
                    .arg(&e_i)
                    .launch(cfg((1, 1, 1), 256, 0))
            }
            .expect("moe_group");
            let substituted = i32::from(call % 2 == 1);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&count)
                    .arg(&tiles)
                    .arg(&mut counts)
                    .arg(&substituted)
                    .launch(cfg((1, 1, 1), 32, 0))
            }
            .expect("moe_count_experts");
            let computed = groups.of(&members).count() as u64;
            want[0] += computed;
            if substituted == 1 {
                want[1] += computed;
            }
            let got = stream.clone_dtoh(&counts).expect("dtoh");
            assert_eq!(
                got, want,
                "{n} tokens, top-{k}, {e} experts, members {members:?} (call {call}): \
                 {computed} experts got entries"
            );
        }
    }
    println!("counted (all, substituted): {want:?}");
}
