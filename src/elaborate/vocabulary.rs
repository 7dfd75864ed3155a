//! The words a schedule may use, one table per kind: the evaluator's "unknown ..."
//! suggestions read them, and `docs/language.md`'s test checks that every one has an entry
//! there, so a word added to the language without a reference entry fails CI.
//!
//! The op names are the op table's (`ir::catalog::OPS`), the size helpers
//! `ir::catalog::SIZE_HELPERS`, engines, spaces, eviction policies and predictors their
//! enums' `ALL`; the hardware symbols come from the profile (`cost::HardwareProfile::symbols`).

/// Built-in functions other than the size helpers.
pub const FUNCTIONS: [&str; 14] = [
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
    "score_max",
    "score_sum",
];

/// Methods of a buffer slice (`W[l].expert(e)`, `kv[l].context()`, ...).
pub const SLICE_METHODS: [&str; 7] = [
    "page", "share", "expert", "experts", "context", "appended", "format",
];

/// Methods of an expert cache (`ec.slot(l, e)`, `ec.predicted(l, r)`,
/// `ec.resident(l, e)`).
pub const CACHE_METHODS: [&str; 3] = ["slot", "predicted", "resident"];

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
