//! `moec models`: list the built-in model cards with parameter counts and bytes per layer.

use crate::model::ModelCard;
use std::process::ExitCode;

/// Arguments of `moec models` (none).
#[derive(Debug, clap::Args)]
pub struct ModelsArgs {}

fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

fn human_params(p: u64) -> String {
    let p = p as f64;
    if p >= 1e9 {
        format!("{:.2} B", p / 1e9)
    } else {
        format!("{:.1} M", p / 1e6)
    }
}

/// Runs `moec models`.
pub fn run(_args: &ModelsArgs) -> ExitCode {
    println!(
        "{:<15} {:<8} {:>6} {:>10} {:>10} {:>11} {:>10} {:>10} {:>14} {:>10}",
        "card",
        "family",
        "layers",
        "params",
        "active",
        "attn/layer",
        "router",
        "shared",
        "experts/layer",
        "total"
    );
    for card in ModelCard::builtins() {
        println!(
            "{:<15} {:<8} {:>6} {:>10} {:>10} {:>11} {:>10} {:>10} {:>14} {:>10}",
            card.name,
            format!("{:?}", card.family),
            card.layers,
            human_params(card.total_params()),
            human_params(card.active_params()),
            human_bytes(card.attn_bytes()),
            human_bytes(card.router_bytes()),
            if card.shared_ffn > 0 {
                human_bytes(card.shared_params() * card.dtype.bytes())
            } else {
                "-".to_string()
            },
            format!("{}x{}", card.experts, human_bytes(card.expert_bytes())),
            human_bytes(card.total_bytes()),
        );
    }
    println!(
        "(bytes in each card's dtype; params = all / active per token incl. embedding and lm_head; \
         shared = the shared expert every token runs, part of the layer's dense weights)"
    );
    ExitCode::SUCCESS
}
