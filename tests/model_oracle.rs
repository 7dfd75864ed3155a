//! The oracle on synthetic tiny checkpoints: generation is not degenerate, seeded
//! sampling is reproducible, and every kernel is batch-invariant (a token's numbers are
//! bit-identical whichever micro-batch computes it), which the runtime's schedules rely on
//! to reproduce the oracle's tokens exactly.

use moec::math::attention::{attention, AttnSeq};
use moec::math::head::logits;
use moec::math::kv_cache::PagedKvCache;
use moec::math::moe::{combine, expert_ffn, gate};
use moec::math::projection::{o_proj_residual, pre_attn};
use moec::math::rope::RopeTable;
use moec::model::vocab::ExpertGroups;
use moec::model::vocab::KvLayout;
use moec::model::vocab::RoutedRow;
use moec::model::vocab::Sampling;
use moec::model::ModelCard;
use moec::oracle::{GenerateOptions, Oracle};
use moec::weights::checkpoint::Checkpoint;
use moec::weights::synth::{write_checkpoint, SynthOptions};
use moec::weights::tokenizer::TextTokenizer;
use std::path::PathBuf;

fn tiny(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    write_checkpoint(
        &ModelCard::load(name).unwrap(),
        &dir,
        &SynthOptions::default(),
    )
    .unwrap();
    (tmp, dir)
}

#[test]
fn generation_is_not_degenerate_for_either_family() {
    for name in [
        "mixtral-tiny",
        "dbrx-tiny",
        "qwen3-moe-tiny",
        "olmoe-tiny",
        "qwen2-moe-tiny",
        "gpt-oss-tiny",
        "deepseek-v2-tiny",
        "deepseek-v3-tiny",
    ] {
        let (_tmp, dir) = tiny(name);
        let ck = Checkpoint::open(&dir).unwrap();
        let tok = TextTokenizer::load(ck.card(), Some(&dir)).unwrap();
        let oracle = Oracle::new(&ck).unwrap();
        let prompts = vec![
            tok.encode("The capital of France is").unwrap(),
            tok.encode("def fibonacci(n):").unwrap(),
        ];
        let opts = GenerateOptions {
            stop_at_eos: false,
            ..GenerateOptions::greedy(32)
        };
        let out = oracle.generate(&prompts, &opts).unwrap();
        assert_ne!(
            out[0].token_ids, out[1].token_ids,
            "{name}: different prompts, different continuations"
        );
        for o in &out {
            assert_eq!(o.token_ids.len(), 32);
            let mut distinct = o.token_ids.clone();
            distinct.sort();
            distinct.dedup();
            assert!(
                distinct.len() >= 8,
                "{name}: only {} distinct tokens in {:?}",
                distinct.len(),
                o.token_ids
            );
            assert!(o.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        }
    }
}

#[test]
fn seeded_sampling_repeats_and_seeds_differ() {
    let (_tmp, dir) = tiny("mixtral-tiny");
    let ck = Checkpoint::open(&dir).unwrap();
    let oracle = Oracle::new(&ck).unwrap();
    let prompts = vec![vec![1, 415, 5565, 302]];
    let opts = |seed| GenerateOptions {
        max_new_tokens: 24,
        sampling: Sampling::Temperature {
            temperature: 1.0,
            top_p: 0.9,
        },
        seed,
        stop_at_eos: false,
    };
    let a = oracle.generate(&prompts, &opts(7)).unwrap();
    assert_eq!(a, oracle.generate(&prompts, &opts(7)).unwrap());
    assert_ne!(
        a[0].token_ids,
        oracle.generate(&prompts, &opts(8)).unwrap()[0].token_ids
    );
}

/// Prompts generated together (one micro-batch of mixed lengths) give bit-identical
/// tokens, logprobs and logits to each prompt generated alone.
#[test]
fn batched_generation_equals_one_prompt_at_a_time() {
    for name in [
        "mixtral-tiny",
        "dbrx-tiny",
        "qwen3-moe-tiny",
        "olmoe-tiny",
        "qwen2-moe-tiny",
        "gpt-oss-tiny",
        "deepseek-v2-tiny",
        "deepseek-v3-tiny",
    ] {
        let (_tmp, dir) = tiny(name);
        let ck = Checkpoint::open(&dir).unwrap();
        let oracle = Oracle::new(&ck).unwrap();
        let prompts: Vec<Vec<u32>> = vec![
            vec![1, 20, 300, 4000, 50],
            (1..40).map(|i| i * 37 % 1000).collect(),
            vec![1, 7],
        ];
        let opts = GenerateOptions {
            stop_at_eos: false,
            ..GenerateOptions::greedy(10)
        };
        let together = oracle.generate(&prompts, &opts).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let alone = oracle.generate(std::slice::from_ref(p), &opts).unwrap();
            assert_eq!(alone[0], together[i], "{name}: prompt {i}");
        }
    }
}

/// Maps rows `[lo, hi)` of a test input to an op's output rows.
type RowOp<'a> = Box<dyn Fn(usize, usize) -> Vec<f32> + 'a>;

/// Every matmul-using kernel (qkv, o_proj, experts, lm_head) gives bit-identical rows for
/// one call of 37 rows, 37 calls of one row, and calls of 5 + 32 rows.
#[test]
fn row_kernels_are_batch_invariant() {
    for name in [
        "mixtral-tiny",
        "dbrx-tiny",
        "qwen3-moe-tiny",
        "olmoe-tiny",
        "qwen2-moe-tiny",
        "gpt-oss-tiny",
        "deepseek-v2-tiny",
        "deepseek-v3-tiny",
    ] {
        let (_tmp, dir) = tiny(name);
        let ck = Checkpoint::open(&dir).unwrap();
        let a = ck.arch().clone();
        let w = ck.model_weights().unwrap();
        let layer = &w.layers[2];
        let d = a.hidden;
        let rope = RopeTable::new(a.rope_theta, a.attn.head_dim, 128);
        let x: Vec<f32> = (0..37 * d)
            .map(|i| ((i * 7919) % 1013) as f32 / 300.0 - 1.7)
            .collect();
        let positions: Vec<usize> = (0..37).map(|i| (i * 3) % 100).collect();
        // Each op maps rows [lo, hi) of x to its output rows.
        let ops: Vec<(&str, usize, RowOp<'_>)> = vec![
            (
                "qkv",
                a.attn.qkv_width(),
                Box::new(|lo, hi| {
                    let n = hi - lo;
                    let mut scratch = vec![0.0; n * d];
                    let mut out = vec![0.0; n * a.attn.qkv_width()];
                    pre_attn(
                        &a,
                        &layer.dense,
                        &rope,
                        &x[lo * d..hi * d],
                        &positions[lo..hi],
                        &mut scratch,
                        &mut out,
                    )
                    .unwrap();
                    out
                }),
            ),
            (
                "o_proj",
                d,
                Box::new(|lo, hi| {
                    let q = a.q_dim();
                    let attn: Vec<f32> = (lo * q..hi * q)
                        .map(|i| ((i * 31) % 97) as f32 / 50.0 - 1.0)
                        .collect();
                    let mut res = x[lo * d..hi * d].to_vec();
                    o_proj_residual(&a, &layer.dense, &attn, &mut res).unwrap();
                    res
                }),
            ),
            (
                "expert",
                a.top_k * d,
                Box::new(|lo, hi| {
                    let rows: Vec<RoutedRow> = (0..(hi - lo) as u32)
                        .map(|row| RoutedRow {
                            row,
                            slot: 1,
                            weight: 0.375,
                        })
                        .collect();
                    let mut out = vec![0.0; (hi - lo) * a.top_k * d];
                    expert_ffn(&a, &layer.experts[1], &x[lo * d..hi * d], &rows, &mut out).unwrap();
                    out
                }),
            ),
            (
                "lm_head",
                a.vocab,
                Box::new(|lo, hi| {
                    let mut out = vec![0.0; (hi - lo) * a.vocab];
                    logits(&a, w.final_norm, &w.lm_head, &x[lo * d..hi * d], &mut out).unwrap();
                    out
                }),
            ),
        ];
        for (op, width, f) in &ops {
            let all = f(0, 37);
            let mut split = f(0, 5);
            split.extend(f(5, 37));
            let mut ones = Vec::new();
            for t in 0..37 {
                ones.extend(f(t, t + 1));
            }
            assert_eq!(all.len(), 37 * width);
            assert_eq!(all, split, "{name} {op}: 37 rows vs 5 + 32");
            assert_eq!(all, ones, "{name} {op}: 37 rows vs 37 x 1");
        }
    }
}

/// Attention over three sequences (prefill of different lengths, then a mixed step) is
/// bit-identical whether the sequences share a call or run alone in other blocks.
#[test]
fn attention_is_invariant_to_sequence_grouping() {
    let (_tmp, dir) = tiny("mixtral-tiny");
    let ck = Checkpoint::open(&dir).unwrap();
    let shape = ck.arch().attn;
    let layout = KvLayout {
        block_size: 16,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        values_in_keys: None,
    };
    let lens = [5usize, 19, 33];
    let w = shape.qkv_width();
    let data: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..(n + 1) * w)
                .map(|i| (((i + s * 101) * 2654435761usize) % 2000) as f32 / 1000.0 - 1.0)
                .collect()
        })
        .collect();
    // Together: one prefill call for all three, then one decode call.
    let mut cache = PagedKvCache::new(layout, 1, 16);
    let mut tables = vec![Vec::new(); 3];
    for (t, &n) in tables.iter_mut().zip(&lens) {
        cache.allocator.grow(&layout, t, n + 1).unwrap();
    }
    let qkv: Vec<f32> = data
        .iter()
        .zip(&lens)
        .flat_map(|(d, &n)| d[..n * w].to_vec())
        .collect();
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .zip(&lens)
        .map(|(t, &n)| AttnSeq {
            block_table: t,
            context_len: 0,
            n_new: n,
        })
        .collect();
    let mut together = vec![0.0; lens.iter().sum::<usize>() * shape.q_width()];
    attention(&mut cache.layer_mut(0), &seqs, &qkv, &shape, &mut together).unwrap();
    let step: Vec<f32> = data
        .iter()
        .zip(&lens)
        .flat_map(|(d, &n)| d[n * w..(n + 1) * w].to_vec())
        .collect();
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .zip(&lens)
        .map(|(t, &n)| AttnSeq {
            block_table: t,
            context_len: n,
            n_new: 1,
        })
        .collect();
    let mut together_step = vec![0.0; 3 * shape.q_width()];
    attention(
        &mut cache.layer_mut(0),
        &seqs,
        &step,
        &shape,
        &mut together_step,
    )
    .unwrap();
    // Alone, in reverse order, in a fresh cache (different block ids).
    let mut cache = PagedKvCache::new(layout, 1, 16);
    let mut offset = lens.iter().sum::<usize>();
    for s in (0..3).rev() {
        let mut table = Vec::new();
        cache
            .allocator
            .grow(&layout, &mut table, lens[s] + 1)
            .unwrap();
        let mut out = vec![0.0; lens[s] * shape.q_width()];
        let seq = [AttnSeq {
            block_table: &table,
            context_len: 0,
            n_new: lens[s],
        }];
        attention(
            &mut cache.layer_mut(0),
            &seq,
            &data[s][..lens[s] * w],
            &shape,
            &mut out,
        )
        .unwrap();
        offset -= lens[s];
        assert_eq!(
            out,
            together[offset * shape.q_width()..(offset + lens[s]) * shape.q_width()],
            "prefill seq {s}"
        );
        let seq = [AttnSeq {
            block_table: &table,
            context_len: lens[s],
            n_new: 1,
        }];
        let mut one = vec![0.0; shape.q_width()];
        attention(
            &mut cache.layer_mut(0),
            &seq,
            &data[s][lens[s] * w..(lens[s] + 1) * w],
            &shape,
            &mut one,
        )
        .unwrap();
        assert_eq!(
            one,
            together_step[s * shape.q_width()..(s + 1) * shape.q_width()],
            "decode seq {s}"
        );
    }
}

/// The MoE output is bit-identical whatever order the experts run in (hot-first,
/// reversed): each expert writes its own slots and `combine` fixes the summation order.
#[test]
fn expert_execution_order_does_not_change_the_result() {
    let (_tmp, dir) = tiny("dbrx-tiny");
    let ck = Checkpoint::open(&dir).unwrap();
    let a = ck.arch().clone();
    let w = ck.model_weights().unwrap();
    let layer = &w.layers[1];
    let n = 23;
    let residual: Vec<f32> = (0..n * a.hidden)
        .map(|i| ((i * 613) % 401) as f32 / 200.0 - 1.0)
        .collect();
    let mut x_norm = vec![0.0; residual.len()];
    let routing = gate(&a, &layer.dense, &residual, &mut x_norm).unwrap();
    let groups = ExpertGroups::new(&routing, a.experts);
    let run = |order: &[usize]| {
        let mut slots = vec![0.0; n * a.top_k * a.hidden];
        for &e in order {
            expert_ffn(
                &a,
                &layer.experts[e],
                &x_norm,
                groups.rows_of(e as u32),
                &mut slots,
            )
            .unwrap();
        }
        let mut out = residual.clone();
        combine(&routing, &slots, &mut out).unwrap();
        out
    };
    let ascending: Vec<usize> = (0..a.experts).collect();
    let reversed: Vec<usize> = (0..a.experts).rev().collect();
    let mut hot_first = ascending.clone();
    hot_first.sort_by_key(|&e| std::cmp::Reverse(groups.rows_of(e as u32).len()));
    let reference = run(&ascending);
    assert_eq!(reference, run(&reversed));
    assert_eq!(reference, run(&hot_first));
    assert_ne!(reference, residual, "the MoE block changed the residual");
}

/// The oracle with every instruction set this CPU has against the portable kernels, on
/// both tiny cards: the SIMD bodies accumulate in the portable bodies' order, so the greedy
/// tokens and every logit are bit-identical (the largest logit difference is printed).
#[test]
fn simd_and_portable_kernels_give_the_same_generation() {
    use moec::math::isa::{Isa, Kernels};
    for name in [
        "mixtral-tiny",
        "dbrx-tiny",
        "qwen3-moe-tiny",
        "olmoe-tiny",
        "qwen2-moe-tiny",
        "gpt-oss-tiny",
        "deepseek-v2-tiny",
        "deepseek-v3-tiny",
    ] {
        let (_tmp, dir) = tiny(name);
        let ck = Checkpoint::open(&dir).unwrap();
        let prompts = vec![vec![1, 415, 5565, 302, 4843], vec![1, 28705, 13, 9]];
        let opts = GenerateOptions {
            stop_at_eos: false,
            ..GenerateOptions::greedy(12)
        };
        let portable = Oracle::new(&ck)
            .unwrap()
            .with_kernels(Kernels::portable())
            .generate(&prompts, &opts)
            .unwrap();
        for isa in Isa::supported().into_iter().filter(|&i| i != Isa::Portable) {
            let simd = Oracle::new(&ck)
                .unwrap()
                .with_kernels(Kernels::new(isa).unwrap())
                .generate(&prompts, &opts)
                .unwrap();
            let mut max_diff = 0.0f32;
            for (p, s) in portable.iter().zip(&simd) {
                assert_eq!(p.token_ids, s.token_ids, "{name} {isa}: greedy tokens");
                for (a, b) in p.prompt_logits.iter().zip(&s.prompt_logits) {
                    max_diff = max_diff.max((a - b).abs());
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&p.prompt_logits),
                    bits(&s.prompt_logits),
                    "{name} {isa}: prompt logits"
                );
                assert_eq!(bits(&p.logprobs), bits(&s.logprobs), "{name} {isa}");
            }
            println!("{name}: {isa} vs portable: tokens equal, max logit difference {max_diff:e}");
        }
    }
}
