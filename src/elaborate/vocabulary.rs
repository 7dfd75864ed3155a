//! The words a schedule may use, one table per kind: the evaluator's "unknown ..."
//! suggestions read them, and `docs/language.md`'s test checks that every one has an entry
//! there, so a word added to the language without a reference entry fails CI.
//!
//! The op names are the op table's (`ir::catalog::OPS`), the size helpers
//! `ir::catalog::SIZE_HELPERS`, engines, spaces, eviction policies and predictors their
//! enums' `ALL`; the hardware symbols come from the profile (`cost::HardwareProfile::symbols`).

/// Built-in functions other than the size helpers.
pub const FUNCTIONS: [&str; 12] = [
    "min",
    "max",
    "ceil",
    "floor",
    "select",
    "bytes",
    "hw_or",
    "hot",
    "active",
    "routed",
    "rank",
    "rank_in_layer",
];

/// Methods of a buffer slice (`W[l].expert(e)`, `kv[l].context()`, ...).
pub const SLICE_METHODS: [&str; 6] = ["page", "share", "expert", "experts", "context", "appended"];

/// Methods of an expert cache (`ec.slot(l, e)`, `ec.predicted(l, r)`).
pub const CACHE_METHODS: [&str; 2] = ["slot", "predicted"];

/// Fields of the checkpoint `W`, of a layer-shaped slice and of its dense part.
pub const FIELDS: [&str; 9] = [
    "embed", "head", "pre", "o", "gate", "attn", "post", "dense", "experts",
];

/// Model and workload symbols, known without a hardware profile.
pub const SYMBOLS: [&str; 13] = [
    "layers",
    "dense_layers",
    "experts",
    "top_k",
    "hidden",
    "ffn",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "batch",
    "prompt_len",
    "gen_len",
];

/// Words an op argument takes as a value (`part = decode`, `set = all`).
pub const WORDS: [&str; 3] = ["prefill", "decode", "all"];

/// Prefixes of the hardware symbols (`gpu.mem`, `lat.gpu`, ...): naming one without
/// `--hw` is an error that says so rather than "unknown name".
pub const HARDWARE_PREFIXES: [&str; 7] =
    ["gpu.", "pinned.", "host.", "cpu.", "link.", "disk.", "lat."];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{compile, Options};
    use crate::model::card::ModelCard;

    /// The messages of the errors (not warnings) of a schedule with `items` at top level
    /// and `body` in its prefill step.
    fn errors(items: &str, body: &str) -> Vec<String> {
        let source = format!(
            "schedule t\nmicrobatches 1 of 1\nstream gpu: gpu.compute\n{items}\nprefill {{\n{body}\n}}\n"
        );
        let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
        let diags = compile(&source, &options).err().unwrap_or_default();
        diags
            .iter()
            .filter(|d| d.is_error())
            .map(|d| d.message.clone())
            .collect()
    }

    /// Each table names words the evaluator knows: a word the table lists but the
    /// evaluator does not would send users (and the reference) to a word that fails.
    #[test]
    fn every_listed_word_is_one_the_evaluator_knows() {
        for f in FUNCTIONS {
            let errs = errors(&format!("let x = {f}()"), "");
            assert!(
                errs.iter().all(|e| !e.starts_with("unknown function")),
                "{f}: {errs:?}"
            );
        }
        // The test schedule samples nothing, which the checker reports; only "unknown ..."
        // errors say a word is not known.
        let known = |errs: &[String]| errs.iter().all(|e| !e.starts_with("unknown"));
        for s in SYMBOLS {
            let errs = errors(&format!("let x = {s}"), "");
            assert!(known(&errs), "{s}: {errs:?}");
        }
        for m in SLICE_METHODS {
            let errs = errors(&format!("let x = bytes(W[0].{m}())"), "");
            assert!(
                errs.iter().all(|e| !e.starts_with("unknown method")),
                "{m}: {errs:?}"
            );
        }
        for m in CACHE_METHODS {
            let errs = errors(
                &format!("cache ec[2]: gpu evict \"lru\"\nlet x = bytes(ec.{m}(0, 0))"),
                "",
            );
            assert!(
                errs.iter().all(|e| !e.starts_with("unknown method")),
                "{m}: {errs:?}"
            );
        }
        for f in FIELDS {
            let base = if matches!(f, "embed" | "head") {
                "W"
            } else {
                "W[0]"
            };
            let errs = errors(&format!("let x = bytes({base}.{f})"), "");
            assert!(known(&errs), "{f}: {errs:?}");
        }
    }

    /// Issue 45: a misspelt method on a run-time expert's slice said "must be known at
    /// compile time"; the name is the problem, and the message says so.
    #[test]
    fn an_unknown_method_is_named_before_the_run_time_expert_rule() {
        let errs = errors(
            "buffer w: gpu = expert_weights(1)",
            "  copy W[0].expert(hot(0, 0)).q4() -> w on gpu",
        );
        assert_eq!(
            errs.first().map(String::as_str),
            Some("unknown method `q4`"),
            "{errs:?}"
        );
        // A real slice method on a run-time expert still meets the run-time rule.
        let errs = errors(
            "buffer w: gpu = expert_weights(1)",
            "  copy W[0].expert(hot(0, 0)).page(0, 2) -> w on gpu",
        );
        assert!(
            errs.first()
                .is_some_and(|e| e.contains("known at compile time")),
            "{errs:?}"
        );
    }
}
