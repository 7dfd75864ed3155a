//! moec's greedy tokens on GGUF files made by llama.cpp's own tools equal llama.cpp's.
//!
//! The fixtures (a tiny Mixtral as f32, Q8_0 and Q4_K_M GGUFs, the last mixing Q4_K and
//! Q6_K tensors) and llama.cpp's greedy tokens on them come from `scripts/gguf_fixtures.sh`;
//! the tokens are checked in (`tests/fixtures/gguf/llama_greedy.json`), the GGUFs are found
//! by their sha256 (`SHA256SUMS`) in `$MOEC_GGUF_FIXTURES` (default
//! `~/.cache/moec-peer/gguf-fixtures`). Without them the test says why and passes: building
//! llama.cpp takes longer than CI allows on 2 cores.
//!
//! Tolerance: at least 95% of the 16 positions (issue 29's bar). moec decodes blocks as
//! ggml's reference decoder does and multiplies in f32; llama.cpp multiplies quantised
//! weights with activations it quantises to 8 bits, so the logits differ slightly and a
//! near tie may flip a token; on these fixtures all 16 agree for every type. The test
//! also prints how far the first step's logits are from llama.cpp's (the harness writes
//! them beside the tokens): 0.0053 on the f32 file, 0.135 (Q8_0) and 0.198 (Q4_K_M) of a
//! spread of 28.6 on 2026-11-26. It does not bound them yet: where the quantised files part
//! from llama.cpp is still to be found (issue 29), and a bound that only states today's
//! figure would prove nothing.

use moec::model::oracle::{GenerateOptions, Oracle};
use moec::model::Checkpoint;

use crate::gguf_common::fixtures;

#[test]
fn greedy_tokens_match_llama_cpp_on_its_own_ggufs() {
    let Some(dir) = fixtures() else {
        eprintln!(
            "gguf_parity: skipped: no GGUF fixtures (run scripts/gguf_fixtures.sh, or set \
             MOEC_GGUF_FIXTURES)"
        );
        return;
    };
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("../fixtures/gguf/llama_greedy.json")).unwrap();
    let prompt: Vec<u32> = golden["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    for ty in ["f32", "Q8_0", "Q4_K_M"] {
        let want: Vec<u32> = golden["greedy"][ty]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let path = dir.join(format!("mixtral-q4-{ty}.gguf"));
        let ck = Checkpoint::open_gguf(&path, None).unwrap();
        let mut opts = GenerateOptions::greedy(want.len());
        opts.stop_at_eos = false;
        let got = Oracle::new(&ck)
            .unwrap()
            .generate(std::slice::from_ref(&prompt), &opts)
            .unwrap();
        // llama.cpp's logits at the last prompt position, where the harness wrote them.
        let llama_logits: Option<Vec<f32>> =
            std::fs::read_to_string(dir.join(format!("llama-{ty}.json")))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| {
                    v["first_logits"].as_array().map(|a| {
                        a.iter()
                            .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
                            .collect()
                    })
                });
        if let Some(want_logits) = &llama_logits {
            let ours = &got[0].prompt_logits;
            let max_diff = ours
                .iter()
                .zip(want_logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            let spread = want_logits.iter().fold(f32::MIN, |a, &b| a.max(b))
                - want_logits.iter().fold(f32::MAX, |a, &b| a.min(b));
            eprintln!("gguf_parity: {ty}: first-step logits differ from llama.cpp's by at most {max_diff} (their spread {spread})");
        }
        let got = &got[0].token_ids;
        let agree = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        eprintln!(
            "gguf_parity: {ty}: {agree} of {} greedy tokens equal llama.cpp's",
            want.len()
        );
        assert!(
            agree * 100 >= 95 * want.len(),
            "{ty}: {agree} of {} tokens agree\nmoec  {got:?}\nllama {want:?}",
            want.len()
        );
    }
}

/// The Q4_K_M file's layer images hold each layer's own formats as llama.cpp's quantize
/// log lists them (layer 0: Q4_K `ffn_down_exps`; layer 1: Q6_K), in one geometry: every
/// layer reserves Q6_K room for `ffn_down`, so offsets and sizes agree and the compiled
/// schedule's checkpoint layout (from the card the file gives) matches the image. Byte
/// counts are ggml's block structs: 144 bytes per 256 Q4_K weights, 210 per 256 Q6_K.
#[test]
fn q4_k_m_layer_images_keep_each_layer_s_formats_in_one_geometry() {
    use moec::model::layout::SegmentKind;
    use moec::model::quant::QuantFormat;
    let Some(dir) = fixtures() else {
        eprintln!("gguf_parity: skipped: no GGUF fixtures (run scripts/gguf_fixtures.sh)");
        return;
    };
    let ck = Checkpoint::open_gguf(&dir.join("mixtral-q4-Q4_K_M.gguf"), None).unwrap();
    let (l0, l1) = (ck.layer_layout(0).unwrap(), ck.layer_layout(1).unwrap());
    let down = SegmentKind::ExpertDown(3);
    let (d0, d1) = (l0.segment(down).unwrap(), l1.segment(down).unwrap());
    assert_eq!(
        (d0.quant, d1.quant),
        (Some(QuantFormat::Q4K), Some(QuantFormat::Q6K))
    );
    // 256 rows of 512 weights: 2 super-blocks a row.
    assert_eq!((d0.len_bytes, d1.len_bytes), (256 * 2 * 144, 256 * 2 * 210));
    assert_eq!((d0.slot_bytes, d0.offset), (d1.slot_bytes, d1.offset));
    assert_eq!(l0.image_bytes, l1.image_bytes);
    let v = |l: &moec::model::LayerLayout| l.segment(SegmentKind::VProj).unwrap().quant;
    assert_eq!(
        (v(&l0), v(&l1)),
        (Some(QuantFormat::Q4K), Some(QuantFormat::Q6K))
    );
    let layout = moec::ir::CheckpointLayout::new(ck.card());
    assert_eq!(layout.layer_bytes_of(0), l0.image_bytes as u64);
    assert_eq!(layout.expert_bytes, l1.expert_range(0).len() as u64);
    // The embedding (Q4_K) and lm_head (Q6_K) as the quantize log sizes them.
    assert_eq!(layout.embed_bytes, 32000 * 144);
    assert_eq!(layout.head_bytes, 256 * 4 + 32000 * 210);
}
