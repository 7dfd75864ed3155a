//! Guarded tasks charged by expected activation: a batch-1 decode step of `fiddler.sched`
//! on Mixtral-8x7B (Fiddler's Table 1 setting: 56 resident experts on the Quadro RTX 6000
//! profile) costs the experts one token is expected to run, checked against hand
//! arithmetic.

use moec::compile::{compile, Options};
use moec::cost::activation::activation;
use moec::cost::hardware::{HardwareProfile, Level};
use moec::cost::predict::{predict, CostSettings};
use moec::ir::{Op, StepKind, TaskId, Workload};
use moec::model::card::ModelCard;

#[test]
fn a_batch_one_decode_step_charges_only_the_expected_active_experts() {
    let source = std::fs::read_to_string("schedules/fiddler.sched").expect("schedule");
    let card = ModelCard::load("mixtral-8x7b").expect("card");
    let hw = HardwareProfile::load("quadro-rtx6000").expect("profile");
    let mut options = Options::new(card.clone());
    options.workload = Workload {
        batch: 1,
        prompt_len: 128,
        gen_len: 32,
    };
    options.hardware = hw
        .symbols()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    options.sets = vec![("n_gpu".to_string(), "56".to_string())];
    let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{}", d[0]));
    let program = &compiled.program;
    let decode = program
        .steps
        .iter()
        .position(|s| s.kind == StepKind::Decode)
        .expect("a decode step");
    // One token routes to top_k = 2 of 8 experts: each expert is active with probability
    // exactly 1/4, and over a layer's 8 expert computations (whatever arm) the expected
    // number that run is 2, so 32 layers run 64.
    let mut expected_runs = 0.0;
    for id in program.steps[decode].task_ids() {
        let task = program.task(id);
        if let Op::Experts { .. } = task.op {
            let act = activation(program, id, task.shape.tokens);
            expected_runs += act.runs;
            assert!(
                act.runs == 0.0 || (act.runs - 0.25).abs() < 1e-12,
                "{}: {}",
                program.task_name(id),
                act.runs
            );
        }
    }
    assert!((expected_runs - 64.0).abs() < 1e-9, "{expected_runs}");
    // The CPU arm: 256 - 56 = 200 experts, a quarter of them expected to run, each reading
    // its 3 x 4096 x 14336 bf16 weights once at the CPU's 180 GB/s (one token is memory
    // bound): 50 x 352,321,536 B / 180 GB/s = 97.87 ms.
    let deps: Vec<Vec<TaskId>> = (0..program.tasks.len())
        .map(|t| {
            compiled
                .info
                .dag
                .preds(TaskId::new(t))
                .iter()
                .map(|d| d.from)
                .collect()
        })
        .collect();
    let prediction = predict(program, &deps, &hw, &CostSettings::default()).expect("predicts");
    let step = &prediction.steps[decode];
    let cpu = step
        .arms
        .iter()
        .find(|a| a.arm.starts_with("experts on cpu"))
        .expect("a CPU arm");
    assert_eq!(cpu.tasks, 200);
    assert!((cpu.expected_share - 0.25).abs() < 1e-12);
    let expert_bytes = 3.0 * 4096.0 * 14336.0 * 2.0;
    let hand = 50.0 * expert_bytes / hw.level_bandwidth(Level::Host);
    assert!(
        (cpu.seconds - hand).abs() / hand < 0.01,
        "{} s vs {hand} s",
        cpu.seconds
    );
    // The copy arm needs more tokens than one: never expected in decode.
    let copy = step
        .arms
        .iter()
        .filter(|a| a.arm.contains("routed >="))
        .map(|a| a.expected_share)
        .fold(0.0, f64::max);
    assert_eq!(copy, 0.0);
}
